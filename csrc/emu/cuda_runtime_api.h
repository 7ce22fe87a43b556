// The runtime API header of the CUDA emulation: everything is in cuda_runtime.h.
#pragma once
#include "cuda_runtime.h"
