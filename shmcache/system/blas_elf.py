"""Which library libmlx's ``cblas_sgemm`` calls go to, read from the process.

:func:`bound_in` reads the address in a loaded library's own relocation
slot (GOT entry) for a symbol: the ELF file gives the slot's offset, dlinfo
the library's load address. :func:`file_of` names the file an address lies
in (``dladdr``). Linux, little-endian ELF64 only; the functions return None
where they cannot tell.

Standard library only: :mod:`shmcache.system.blas` runs before mlx is imported.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
from functools import lru_cache


def libmlx_loaded() -> str | None:
    """The path of the libmlx mapped into this process, or None."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                i = line.find("/")
                if i >= 0 and os.path.basename(line[i:].rstrip("\n")).startswith("libmlx.so"):
                    return line[i:].rstrip("\n")
    except OSError:
        pass
    return None


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


@lru_cache(maxsize=1)
def _libdl():
    for name in (None, "libdl.so.2"):
        try:
            lib = ctypes.CDLL(name)
            lib.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
            lib.dladdr.restype = ctypes.c_int
            lib.dlinfo.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
            lib.dlinfo.restype = ctypes.c_int
            return lib
        except (OSError, AttributeError):
            continue
    return None


def file_of(addr: int | None) -> str | None:
    """The file that holds address addr (dladdr), or None."""
    dl = _libdl()
    if not addr or dl is None:
        return None
    d = _DlInfo()
    if not dl.dladdr(ctypes.c_void_p(addr), ctypes.byref(d)) or not d.dli_fname:
        return None
    return os.fsdecode(d.dli_fname)


def global_addr(symbol: str) -> int | None:
    """The address symbol has in the process's global scope (dlsym), or None."""
    try:
        return ctypes.cast(getattr(ctypes.CDLL(None), symbol), ctypes.c_void_p).value
    except (AttributeError, OSError):
        return None


@lru_cache(maxsize=4)
def _reloc_offsets(path: str, symbol: str) -> tuple[int, ...]:
    """The link-time addresses of path's relocation slots (GOT entries) for symbol.

    Reads the ELF file's .dynsym and its SHT_RELA sections; () if it is not a
    little-endian ELF64 file or has no such relocation.
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return _scan_relocs(data, symbol.encode())


def _scan_relocs(data, want: bytes) -> tuple[int, ...]:
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return ()
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    out = []
    for ridx, s in enumerate(secs):
        if s[1] != 4 or s[9] == 0:                     # SHT_RELA
            continue
        symtab = secs[s[6]]
        if symtab[1] != 11:                             # SHT_DYNSYM
            continue
        strtab = secs[symtab[6]]
        str_off, sym_off = strtab[4], symtab[4]
        for off in range(s[4], s[4] + s[5], s[9]):
            r_offset, r_info = struct.unpack_from("<QQ", data, off)
            isym = r_info >> 32
            if isym == 0:
                continue
            st_name, = struct.unpack_from("<I", data, sym_off + isym * 24)
            start = str_off + st_name
            if data[start:start + len(want) + 1] == want + b"\0":
                out.append(r_offset)
    return tuple(out)


def _load_bias(handle: int) -> int | None:
    """l_addr of a loaded object (dlinfo RTLD_DI_LINKMAP), or None."""
    dl = _libdl()
    if dl is None:
        return None
    lm = ctypes.c_void_p()
    if dl.dlinfo(ctypes.c_void_p(handle), 2, ctypes.byref(lm)) != 0 or not lm.value:
        return None
    return ctypes.c_size_t.from_address(lm.value).value     # struct link_map: l_addr first


def bound_in(libpath: str, symbol: str) -> int | None:
    """Where the loaded library libpath's reference to symbol points now (its GOT slot)."""
    try:
        h = ctypes.CDLL(libpath, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)._handle
        offsets = _reloc_offsets(libpath, symbol)
    except (OSError, ValueError, struct.error, IndexError):
        return None
    bias = _load_bias(h)
    if bias is None or not offsets:
        return None
    own = os.path.realpath(libpath)
    for off in offsets:
        target = ctypes.c_void_p.from_address(bias + off).value
        f = file_of(target)
        if f and os.path.realpath(f) != own:      # not a lazy-binding stub of its own PLT
            return target
    return None
