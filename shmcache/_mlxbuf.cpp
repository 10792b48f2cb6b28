// shmcache._mlxbuf: a KV read straight into new MLX arrays, made in the
// calling thread (no evaluation, no zero fill).
//
// read_layer(arena, ids, layer, dtype, threads, threads_above[, stream_above[,
//            shared_stream_above]])
//     -> (k, v) | None:
//     one layer's K and V of the blocks `ids` from the pool's arena (a
//     C-contiguous (L, max_blocks, 2, H, T, D) buffer, see layout), each an
//     evaluated (H, len(ids)*T, D) array of `dtype`, gathered straight into
//     one new buffer (see _gather.h) with the GIL released, on `threads`
//     threads when K and V exceed `threads_above` bytes, else one, with
//     non-temporal stores past `stream_above` bytes, or past
//     `shared_stream_above` (default: stream_above) for what is copied while
//     a helper thread shares the copy (see _gather.h). None
//     (nothing done) unless ids is a list or tuple of plain ints in
//     [0, max_blocks) and the result fits 2 GiB: the caller then takes its
//     own, slower path, which also says what was wrong.
//
// pool_stats() -> dict: what this module's helper pool did (see
//     _gather_pool.h), as shmcache._gather.pool_stats.
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

#include <string>
#include <vector>

#include "_gather.h"
#include "mlx/allocator.h"
#include "mlx/array.h"

namespace nb = nanobind;
namespace mx = mlx::core;

#define STR2(x) #x
#define STR(x) STR2(x)

static constexpr int64_t kPage = 4096;

// A row-major window of `base`'s buffer: `shape` of `dtype` from element `elem`.
static mx::array window(const mx::array& base, const mx::Shape& sh, mx::Dtype dtype, int64_t elem) {
  mx::Strides st(sh.size());
  int64_t size = 1, big = 0;
  for (int i = static_cast<int>(sh.size()) - 1; i >= 0; --i) {
    st[i] = size;
    size *= sh[i];
    big += sh[i] > 1;
  }
  mx::array::Flags f{};
  f.contiguous = true;
  f.row_contiguous = true;
  f.col_contiguous = big <= 1;
  mx::array a(sh, dtype, nullptr, {});
  a.copy_shared_buffer(base, st, f, static_cast<size_t>(size), elem);
  a.set_status(mx::array::Status::available);
  return a;
}

struct Buffer {
  Py_buffer v{};
  ~Buffer() {
    if (v.obj)
      PyBuffer_Release(&v);
  }
};

static int64_t mod_page(int64_t x) { return ((x % kPage) + kPage) % kPage; }

static nb::object read_layer(nb::handle arena, nb::handle ids, int layer, mx::Dtype dtype,
                             int threads, int64_t threads_above, int64_t stream_above,
                             int64_t shared_stream_above) {
  Buffer a;
  if (PyObject_GetBuffer(arena.ptr(), &a.v, PyBUF_C_CONTIGUOUS) < 0)
    throw nb::python_error();
  if (a.v.ndim != 6 || a.v.shape[2] != 2)
    throw nb::value_error("arena must be a C-contiguous (L, max_blocks, 2, H, T, D) buffer");
  const int64_t L = a.v.shape[0], M = a.v.shape[1], H = a.v.shape[3], T = a.v.shape[4],
                D = a.v.shape[5], isz = a.v.itemsize;
  if (layer < 0 || layer >= L)
    throw nb::value_error(("layer " + std::to_string(layer) + " not in [0, " + std::to_string(L) + ")").c_str());
  if (static_cast<int64_t>(dtype.size()) != isz)
    throw nb::value_error("dtype's item size differs from the arena's");
  PyObject* seq = ids.ptr();
  if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq))
    return nb::none();
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  std::vector<int64_t> id(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; i++) {
    int overflow = 0;
    if (!PyLong_CheckExact(items[i]))
      return nb::none();
    long long b = PyLong_AsLongLongAndOverflow(items[i], &overflow);
    if (overflow || b < 0 || b >= M)
      return nb::none();
    id[static_cast<size_t>(i)] = b;
  }
  const int64_t chunk = T * D * isz, stride = 2 * H * chunk, nbytes = H * n * chunk,
                total = 2 * nbytes + 2 * kPage;
  if (total > INT32_MAX)
    return nb::none();
  mx::array base(mx::allocator::malloc(total), mx::Shape{static_cast<int>(total)}, mx::uint8);
  char* dst = reinterpret_cast<char*>(base.data<uint8_t>());
  const char* src = static_cast<const char*>(a.v.buf);
  // NOTE: K and V are placed at their sources' page offsets (the page of
  // slack for each allows it): a few bytes off, the chunk copies ran about
  // 5x slower on the development VM (4K aliasing).
  std::vector<int64_t> so(2 * H), dof(2 * H);
  int64_t at = 0;
  for (int64_t kv = 0; kv < 2; kv++) {
    const int64_t first = layer * M * stride + kv * H * chunk;
    const int64_t skip = mod_page(reinterpret_cast<intptr_t>(src) + first - (reinterpret_cast<intptr_t>(dst) + at));
    at += skip - skip % isz;    // the views need whole items (an odd arena gets near, not equal)
    for (int64_t h = 0; h < H; h++) {
      so[kv * H + h] = first + h * chunk;
      dof[kv * H + h] = at + h * n * chunk;
    }
    at += nbytes;
  }
  char msg[256];
  if (gather_check(total, static_cast<int64_t>(a.v.len), id.data(), n, stride, so.data(), dof.data(),
                   2 * H, chunk, msg, sizeof msg))
    throw nb::value_error(msg);   // cannot happen: the offsets are made above
  {
    nb::gil_scoped_release nogil;
    gather_copy(dst, src, id.data(), n, stride, so.data(), dof.data(), 2 * H, chunk,
                2 * nbytes > threads_above ? threads : 1, stream_above,
                shared_stream_above < 0 ? stream_above : shared_stream_above);
  }
  mx::Shape sh{static_cast<int>(H), static_cast<int>(n * T), static_cast<int>(D)};
  return nb::make_tuple(window(base, sh, dtype, dof[0] / isz), window(base, sh, dtype, dof[H] / isz));
}

NB_MODULE(_mlxbuf, m) {
  m.def("read_layer", &read_layer, nb::arg("arena"), nb::arg("ids").none(), nb::arg("layer"),
        nb::arg("dtype"), nb::arg("threads"), nb::arg("threads_above"),
        nb::arg("stream_above") = int64_t(GATHER_STREAM_BYTES),
        nb::arg("shared_stream_above") = int64_t(-1));
  m.def("pool_stats", []() {
    int64_t c[4];
    gather_pool_stats(c);
    nb::dict d;
    d["helpers"] = c[0], d["shared"] = c[1], d["skipped"] = c[2], d["backoffs"] = c[3];
    return d;
  });
  m.attr("MLX_VERSION") = STR(SHMCACHE_MLX_VERSION);
}
