// What the kernels use of PyTorch: tensors, the few factories they call, the thread pool. Included instead of
// torch/extension.h, all of libtorch's C++ API and pybind11: 33 s of one core to parse in every file, against 6 s
// for these (AMD EPYC Zen 5, GCC 12); decoder.cpp alone includes what binding to Python needs.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>

// The kernels spell the API torch::…, as torch/extension.h offers it.
namespace torch {
using namespace at;
}
