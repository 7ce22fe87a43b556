// The part of DLPack's C exchange API (DLPack 1.x, the `DLPackExchangeAPI` table a framework puts
// on its tensor type as `__dlpack_c_exchange_api__`) that kl_kernels reads: a tensor's address,
// device, dtype, shape and strides from its Python object, with no allocation and no Python-level
// attribute reads. These are DLPack's stable C layouts for major version 1, declared here because
// the extension includes no framework headers; only the function pointer we call is typed.
#pragma once

#include <cstdint>

namespace kl::dlpack {

struct Version {
  uint32_t major;
  uint32_t minor;
};

constexpr uint32_t kMajorVersion = 1;  // the layouts below
constexpr int32_t kDeviceCPU = 1;      // DLDeviceType kDLCPU

struct Device {
  int32_t device_type;
  int32_t device_id;
};

struct DataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};

inline bool operator==(DataType a, DataType b) { return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes; }

// DLTensor: non-owning; valid only while the Python object it came from is alive and unchanged.
struct Tensor {
  void* data;
  Device device;
  int32_t ndim;
  DataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; may be null: compact row-major
  uint64_t byte_offset;
};

struct ExchangeAPIHeader {
  Version version;
  ExchangeAPIHeader* prev_api;  // an older table, or null
};

// Fills `out` for `py_object` (which must be of the type the table came from); 0 on success, -1
// with a Python exception set.
using TensorFromPyObject = int (*)(void* py_object, Tensor* out);

struct ExchangeAPI {
  ExchangeAPIHeader header;
  void* managed_tensor_allocator;               // not used here
  void* managed_tensor_from_py_object_no_sync;  // not used here
  void* managed_tensor_to_py_object_no_sync;    // not used here
  TensorFromPyObject dltensor_from_py_object_no_sync;  // may be null
  void* current_work_stream;                    // not used here
};

}  // namespace kl::dlpack
