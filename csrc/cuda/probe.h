// Host entry points of the CUDA probe (see probe.cu). Each returns a cudaError_t as int.
#pragma once

int kl_probe_device_count(int* count);
int kl_probe_driver_version(int* version);
const char* kl_probe_error_string(int code);
int kl_probe_launch(int device, int* result);
