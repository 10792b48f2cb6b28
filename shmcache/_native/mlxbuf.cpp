// shmcache._mlxbuf: the KV read's one copy, straight into new MLX arrays; and
// model weights as MLX arrays over a read-only shared mapping of their file.
//
// read_layer(arena, ids, layer, dtype) -> (k, v) | None
//     One layer's K and V of the blocks `ids` from the pool's arena (a
//     C-contiguous (L, max_blocks, 2, H, T, D) buffer, see shmcache/shm/layout.py),
//     each an evaluated (H, len(ids)*T, D) array of `dtype`, both views of
//     one new MLX buffer that the blocks are copied into, in block order,
//     with the GIL released. None (nothing done) unless `ids` is a list or
//     tuple of plain ints in [0, max_blocks) and the result fits 2 GiB: the
//     caller then takes its numpy path, which also says what was wrong.
//     Raises ValueError for an arena of another shape, a layer out of range
//     or a dtype whose item size is not the arena's.
//
// map_file(path, tensors) -> [(array, shared)]
//     Arrays over one read-only, shared mapping of the file at `path`
//     (mmap PROT_READ, MAP_SHARED: its pages are the page cache's, one copy
//     for every process that maps the file). `tensors` is a list of
//     (offset, shape, dtype): the array's bytes are the file's
//     [offset, offset + nbytes). An array whose offset is a multiple of its
//     item size and at least 8 is a view of the mapping (shared True); any
//     other is copied into a new MLX buffer (shared False). The mapping is
//     unmapped when the last array over it is freed. Raises ValueError for a
//     tensor that does not lie inside the file, OSError where the file cannot
//     be opened or mapped.
//
// MLX_VERSION: the MLX version this module was compiled against.
//
// NOTE: why C++: MLX's Python API has no uninitialised arrays and cannot
// adopt CPU memory without a copy, so filling a new array from Python pays a
// zero fill or a second copy, plus a hand-off to MLX's stream thread to
// evaluate it. Here the buffer comes from MLX's allocator and the arrays are
// made the way MLX's own CPU kernels make their outputs (allocator::malloc,
// then copy_shared_buffer for the views). That is backend API, whose layout
// may change between versions: shmcache/manager/kv.py uses this module only with the
// MLX version it was compiled against, and after a self-check.
//
// NOTE: one thread: at the sizes the engine reads (one layer of one prefix,
// 1-8 MiB, one read per admitted sequence) the kept helper thread this
// module once had gained nothing on the development VM (docs/performance.md,
// "KV read path"). Each chunk is copied by copy.h's ChunkCopy (AVX2 loads
// and stores, streaming stores for large reads): there, the full read was
// 1.25-2.2x faster with it than with one memcpy per chunk.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "copy.h"
#include "mlx/allocator.h"
#include "mlx/array.h"

namespace nb = nanobind;
namespace mx = mlx::core;

#define STR2(x) #x
#define STR(x) STR2(x)

namespace {

constexpr int64_t kPage = 4096;

// A row-major window of `base`'s buffer: shape `sh` of `dtype` from element `elem`.
mx::array window(const mx::array& base, const mx::Shape& sh, mx::Dtype dtype, int64_t elem) {
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

int64_t mod_page(int64_t x) { return ((x % kPage) + kPage) % kPage; }

// The ids as int64, or false where they are not a list or tuple of plain
// ints in [0, limit).
bool plain_ids(nb::handle ids, int64_t limit, std::vector<int64_t>& out) {
  PyObject* seq = ids.ptr();
  if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq))
    return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  out.resize(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; i++) {
    int overflow = 0;
    if (!PyLong_CheckExact(items[i]))
      return false;
    long long b = PyLong_AsLongLongAndOverflow(items[i], &overflow);
    if (overflow || b < 0 || b >= limit)
      return false;
    out[static_cast<size_t>(i)] = b;
  }
  return true;
}

nb::object read_layer(nb::handle arena, nb::handle ids, int layer, mx::Dtype dtype) {
  Buffer a;
  if (PyObject_GetBuffer(arena.ptr(), &a.v, PyBUF_C_CONTIGUOUS) < 0)
    throw nb::python_error();
  if (a.v.ndim != 6 || a.v.shape[2] != 2)
    throw nb::value_error("arena must be a C-contiguous (L, max_blocks, 2, H, T, D) buffer");
  const int64_t L = a.v.shape[0], M = a.v.shape[1], H = a.v.shape[3], T = a.v.shape[4],
                D = a.v.shape[5], isz = a.v.itemsize;
  if (layer < 0 || layer >= L)
    throw nb::value_error(
        ("layer " + std::to_string(layer) + " not in [0, " + std::to_string(L) + ")").c_str());
  if (static_cast<int64_t>(dtype.size()) != isz)
    throw nb::value_error("dtype's item size differs from the arena's");
  std::vector<int64_t> id;
  if (!plain_ids(ids, M, id))
    return nb::none();
  const int64_t n = static_cast<int64_t>(id.size());
  // chunk: one head of one block, K or V; a block's K and V of all heads in
  // one layer are 2*H consecutive chunks (`stride` bytes).
  const int64_t chunk = T * D * isz, stride = 2 * H * chunk, nbytes = H * n * chunk,
                total = 2 * nbytes + 2 * kPage;
  if (total > INT32_MAX)    // MLX shapes are int32
    return nb::none();
  mx::array base(mx::allocator::malloc(total), mx::Shape{static_cast<int>(total)}, mx::uint8);
  char* dst = reinterpret_cast<char*>(base.data<uint8_t>());
  const char* src = static_cast<const char*>(a.v.buf) + layer * M * stride;
  // NOTE: K and V each start at their source's offset within a page (the
  // page of slack for each allows it): a few bytes off, the chunk copies ran
  // about 5x slower on the development VM (4K aliasing). An arena that is
  // not item-aligned gets the nearest whole item before.
  int64_t at[2], pos = 0;
  for (int64_t kv = 0; kv < 2; kv++) {
    const int64_t skip = mod_page(reinterpret_cast<intptr_t>(src + kv * H * chunk) -
                                  reinterpret_cast<intptr_t>(dst + pos));
    at[kv] = pos + skip - skip % isz;
    pos = at[kv] + nbytes;
  }
  {
    nb::gil_scoped_release nogil;
    const shmcache::ChunkCopy copy(2 * nbytes);   // fences, if it streamed, at the brace
    // Block by block: the source then comes in runs of 2*H chunks, which
    // the hardware prefetcher follows; K|V and head inside, so the result
    // is (K|V, H, n, T, D).
    for (int64_t i = 0; i < n; i++) {
      const char* s = src + id[static_cast<size_t>(i)] * stride;
      for (int64_t j = 0; j < 2 * H; j++)
        copy(dst + at[j / H] + ((j % H) * n + i) * chunk, s + j * chunk, chunk);
    }
  }
  mx::Shape sh{static_cast<int>(H), static_cast<int>(n * T), static_cast<int>(D)};
  return nb::make_tuple(window(base, sh, dtype, at[0] / isz), window(base, sh, dtype, at[1] / isz));
}

// One read-only mapping of a whole file; unmapped when the last array over it goes.
struct Mapping {
  void* base = MAP_FAILED;
  size_t len = 0;
  ~Mapping() {
    if (base != MAP_FAILED)
      munmap(base, len);
  }
};

// NOTE: the array over the mapping is built from a non-owned allocator::Data
// whose deleter only drops the Mapping: MLX never frees it into its
// allocator, and never donates it to an op's output (array::is_donatable()
// is false for non-owned data), so no kernel writes into it; the mapping is
// PROT_READ, so a write through some other path (a writable memoryview of the
// array) faults instead of changing the file. MLX's CPU allocator puts a
// size_t (the buffer's size) before the data it hands out and
// Buffer::raw_ptr() skips it, so the Buffer names the 8 bytes before the
// tensor: they are file bytes (the header or the tensor before), read only
// by MLX's heuristics on whether to reuse a buffer (buffer_size()), never
// written. map_file checks that data() is the tensor's first byte.
mx::array over(const std::shared_ptr<Mapping>& m, int64_t offset, const mx::Shape& sh,
               mx::Dtype dtype) {
  char* at = static_cast<char*>(m->base) + offset;
  mx::allocator::Buffer buf(at - sizeof(size_t));
  mx::array a(mx::allocator::Data(buf, [m](mx::allocator::Buffer) {}), sh, dtype);
  if (a.data<char>() != at)
    throw std::runtime_error("MLX's CPU buffer layout is not the one this module was built for");
  return a;
}

[[noreturn]] void raise_os_error(int err, const std::string& path) {
  errno = err;
  PyErr_SetFromErrnoWithFilename(PyExc_OSError, path.c_str());
  throw nb::python_error();
}

nb::list map_file(const std::string& path, nb::handle tensors) {
  struct Spec {
    int64_t offset;
    mx::Shape shape;
    mx::Dtype dtype;
    int64_t nbytes;
  };
  std::vector<Spec> specs;
  for (nb::handle t : tensors) {
    nb::tuple tup = nb::cast<nb::tuple>(t);
    if (tup.size() != 3)
      throw nb::value_error("each tensor is (offset, shape, dtype)");
    Spec s{nb::cast<int64_t>(tup[0]), {}, nb::cast<mx::Dtype>(tup[2]), 0};
    int64_t n = 1;
    for (nb::handle d : tup[1]) {
      const int64_t v = nb::cast<int64_t>(d);
      if (v < 0 || v > INT32_MAX)
        throw nb::value_error("a dimension is negative or over 2^31");
      s.shape.push_back(static_cast<int>(v));
      n *= v;
    }
    s.nbytes = n * static_cast<int64_t>(s.dtype.size());
    if (s.offset < 0)
      throw nb::value_error("a tensor's offset is negative");
    specs.push_back(std::move(s));
  }
  auto m = std::make_shared<Mapping>();
  {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0)
      raise_os_error(errno, path);
    struct stat st;
    if (fstat(fd, &st) != 0 || st.st_size <= 0) {
      const int e = errno;
      ::close(fd);
      throw nb::value_error((path + ": empty or unreadable (" + std::strerror(e) + ")").c_str());
    }
    m->len = static_cast<size_t>(st.st_size);
    m->base = mmap(nullptr, m->len, PROT_READ, MAP_SHARED, fd, 0);
    const int e = errno;
    ::close(fd);
    if (m->base == MAP_FAILED)
      raise_os_error(e, path);
  }
  nb::list out;
  for (const Spec& s : specs) {
    if (s.offset + s.nbytes > static_cast<int64_t>(m->len))
      throw nb::value_error(("a tensor at offset " + std::to_string(s.offset) +
                             " runs past the end of " + path).c_str());
    const bool shared = s.offset % static_cast<int64_t>(s.dtype.size()) == 0 &&
                        s.offset >= static_cast<int64_t>(sizeof(size_t)) && s.nbytes > 0;
    if (shared) {
      out.append(nb::make_tuple(over(m, s.offset, s.shape, s.dtype), true));
    } else {
      mx::array a(mx::allocator::malloc(std::max<int64_t>(s.nbytes, 1)), s.shape, s.dtype);
      std::memcpy(a.data<char>(), static_cast<char*>(m->base) + s.offset,
                  static_cast<size_t>(s.nbytes));
      out.append(nb::make_tuple(a, false));
    }
  }
  return out;
}

}  // namespace

NB_MODULE(_mlxbuf, m) {
  m.def("read_layer", &read_layer, nb::arg("arena"), nb::arg("ids").none(), nb::arg("layer"),
        nb::arg("dtype"));
  m.def("map_file", &map_file, nb::arg("path"), nb::arg("tensors"));
  m.attr("MLX_VERSION") = STR(SHMCACHE_MLX_VERSION);
}
