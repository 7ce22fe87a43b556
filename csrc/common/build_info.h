// Build facts shared by the CPU (_C) and CUDA (_cuda) extensions.
//
// Kept framework-free on purpose: nothing here (or anywhere in csrc/) includes torch headers,
// so one compiled wheel works with every supported torch version.
#pragma once

#define KL_KERNELS_ABI_VERSION 1

#ifndef KL_KERNELS_CUDA_ARCHS
#define KL_KERNELS_CUDA_ARCHS ""
#endif
