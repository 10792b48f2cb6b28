// shmcache._mlxbuf: new MLX arrays whose bytes the caller writes, made in the
// calling thread (no evaluation, no zero fill).
//
// empty(nbytes) -> (base, address): an evaluated uint8 MLX array of nbytes,
//     its memory straight from MLX's allocator and not yet written, and the
//     address of its first byte.
// views(base, shape, dtype, offsets) -> tuple of arrays: evaluated row-major
//     arrays of `shape` and `dtype`, one per byte offset, sharing base's
//     buffer (each holds it alive; nothing is copied).
//
// NOTE: why C++: MLX's Python API has no uninitialised arrays and cannot
// adopt CPU memory without a copy, so a gather into a new array otherwise
// pays a zero fill or a second copy plus a hand-off to MLX's stream thread to
// evaluate it (50-150 us each on the development VM). Here the array is made
// the way MLX's own CPU kernels make their outputs (allocator::malloc, then
// copy_shared_buffer for the views), which is backend API: the module records
// the MLX version it was compiled against and shmcache/mxbuf.py uses it only
// with that same version, and after a self-check.
#include <nanobind/nanobind.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <string>

#include "mlx/allocator.h"
#include "mlx/array.h"

namespace nb = nanobind;
namespace mx = mlx::core;

#define STR2(x) #x
#define STR(x) STR2(x)

static std::tuple<mx::array, uintptr_t> empty(int64_t nbytes) {
  if (nbytes <= 0 || nbytes > INT32_MAX)
    throw nb::value_error(("nbytes must be in [1, 2**31), got " + std::to_string(nbytes)).c_str());
  mx::array base(mx::allocator::malloc(nbytes), mx::Shape{static_cast<int>(nbytes)}, mx::uint8);
  return {base, reinterpret_cast<uintptr_t>(base.data<uint8_t>())};
}

static std::vector<mx::array> views(const mx::array& base, const std::vector<int>& shape,
                                    mx::Dtype dtype, const std::vector<int64_t>& offsets) {
  if (base.dtype() != mx::uint8 || base.ndim() != 1 || base.status() != mx::array::Status::available)
    throw nb::value_error("base must be an evaluated 1-D uint8 array (from empty())");
  mx::Shape sh(shape.begin(), shape.end());
  mx::Strides st(sh.size());
  int64_t size = 1;
  for (int i = static_cast<int>(sh.size()) - 1; i >= 0; --i) {
    if (sh[i] < 0)
      throw nb::value_error("shape must not be negative");
    st[i] = size;
    size *= sh[i];
  }
  const int64_t isz = dtype.size(), avail = static_cast<int64_t>(base.nbytes());
  for (int64_t off : offsets)
    if (off < 0 || off % isz || off + size * isz > avail)
      throw nb::value_error(("offset " + std::to_string(off) + " must be a multiple of " +
                             std::to_string(isz) + " in [0, " + std::to_string(avail - size * isz) +
                             "] for " + std::to_string(size * isz) + " bytes in a " +
                             std::to_string(avail) + "-byte base").c_str());
  mx::array::Flags f{};
  f.contiguous = true;
  f.row_contiguous = true;
  int big = 0;
  for (auto s : sh)
    big += s > 1;
  f.col_contiguous = big <= 1;
  std::vector<mx::array> out;
  for (int64_t off : offsets) {
    mx::array a(sh, dtype, nullptr, {});
    a.copy_shared_buffer(base, st, f, static_cast<size_t>(size), off / isz);
    a.set_status(mx::array::Status::available);
    out.push_back(std::move(a));
  }
  return out;
}

NB_MODULE(_mlxbuf, m) {
  m.def("empty", &empty, nb::arg("nbytes"));
  m.def("views", &views, nb::arg("base"), nb::arg("shape"), nb::arg("dtype"), nb::arg("offsets"));
  m.attr("MLX_VERSION") = STR(SHMCACHE_MLX_VERSION);
}
