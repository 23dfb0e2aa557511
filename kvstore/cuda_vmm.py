"""GPU memory one process lends another on the same host: CUDA virtual-memory allocations
shared as POSIX file descriptors (the CUDA driver API, through ctypes).

Why not cudaIpc handles: an IPC handle is 64 bytes anyone may send, a name for memory the
sender need not hold, where the agent maps only memory whose descriptor its caller handed
over the local lane (SCM_RIGHTS), as it does for host staging memfds (node_agent/shm.py).
A VMM allocation made with `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR` exports exactly
that: a descriptor the exporter holds, which the importer maps into its own address space
with access for its device. This is how a GPU engine's device staging area reaches the
agent whose pool is on the same GPU: the agent copies pool slots into it device to device,
and the engine copies from it into its paged KV cache, with no host memory between.

`DeviceMemory` exposes `__cuda_array_interface__`, so `torch.as_tensor` wraps it without a
copy; torch's tensor holds a reference to it, so the mapping is released when the last
tensor over it is gone (or at `close()`), never under a copy still running.

Everything here needs a CUDA driver (libcuda.so.1) and a GPU; `why_unavailable()` says why
not without raising. Nothing else in kvstore calls the driver directly.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from kvstore.errors import FailedPrecondition, InvalidArgument

__all__ = ["DeviceMemory", "device_uuid", "granularity", "why_unavailable"]

_CU_MEM_ALLOCATION_TYPE_PINNED = 1
_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
_CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class _Driver:
    """libcuda's entry points, resolved once (the `_v2` name where the header maps to it)."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self._check(self.fn("cuInit")(0), "cuInit")

    def fn(self, name: str):
        for variant in (f"{name}_v2", name):
            f = getattr(self.lib, variant, None)
            if f is not None:
                return f
        raise AttributeError(f"libcuda has no {name}")

    def call(self, name: str, *args) -> None:
        self._check(self.fn(name)(*args), name)

    def _check(self, res: int, what: str) -> None:
        if res == 0:
            return
        msg = ctypes.c_char_p()
        self.lib.cuGetErrorString(res, ctypes.byref(msg))
        text = msg.value.decode() if msg.value else f"error {res}"
        raise FailedPrecondition(f"CUDA {what}: {text}")


_driver: _Driver | None = None
_driver_why = ""
_driver_lock = threading.Lock()


def _drv() -> _Driver:
    global _driver, _driver_why
    with _driver_lock:
        if _driver is None and not _driver_why:
            try:
                _driver = _Driver()
            except (OSError, FailedPrecondition, AttributeError) as exc:
                _driver_why = f"no usable CUDA driver ({exc})"
        if _driver is None:
            raise FailedPrecondition(_driver_why)
        return _driver


def why_unavailable() -> str:
    """'' when device memory can be shared here, else why not (no GPU, no driver)."""
    if not torch.cuda.is_available():
        return "CUDA is not available"
    try:
        _drv()
    except FailedPrecondition as exc:
        return str(exc)
    return ""


_contexts: dict[int, ctypes.c_void_p] = {}


def _device(ordinal: int) -> ctypes.c_int:
    """GPU `ordinal`, with its primary context (the one torch's runtime calls use) current
    on this thread: the driver's memory calls act in the current context."""
    torch.cuda.init()
    d = _drv()
    dev = ctypes.c_int()
    d.call("cuDeviceGet", ctypes.byref(dev), ordinal)
    with _driver_lock:
        ctx = _contexts.get(ordinal)
        if ctx is None:  # retained once, for the life of the process (as torch does)
            ctx = ctypes.c_void_p()
            d.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
            _contexts[ordinal] = ctx
    d.call("cuCtxSetCurrent", ctx)
    return dev


def device_uuid(ordinal: int) -> bytes:
    """The 16-byte UUID of GPU `ordinal` (as this process numbers its GPUs): the same GPU
    has the same UUID in every process, whatever CUDA_VISIBLE_DEVICES each one has."""
    raw = (ctypes.c_ubyte * 16)()
    _drv().call("cuDeviceGetUuid", raw, _device(ordinal))
    return bytes(raw)


def _prop(ordinal: int) -> _AllocationProp:
    prop = _AllocationProp()
    prop.type = _CU_MEM_ALLOCATION_TYPE_PINNED
    prop.requestedHandleTypes = _CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    prop.location = _Location(_CU_MEM_LOCATION_TYPE_DEVICE, ordinal)
    return prop


def granularity(ordinal: int) -> int:
    """The size every shared allocation on GPU `ordinal` is a multiple of (2 MiB on most)."""
    _device(ordinal)
    out = ctypes.c_size_t()
    prop = _prop(ordinal)
    _drv().call(
        "cuMemGetAllocationGranularity",
        ctypes.byref(out),
        ctypes.byref(prop),
        _CU_MEM_ALLOC_GRANULARITY_MINIMUM,
    )
    return int(out.value)


class DeviceMemory:
    """`nbytes` of GPU memory mapped into this process, readable and writable by GPU
    `ordinal`: made here (`allocate`, to lend it) or mapped from a descriptor another
    process lent (`import_fd`)."""

    def __init__(self, ordinal: int, nbytes: int, handle: int, ptr: int) -> None:
        self.ordinal = ordinal
        self.nbytes = nbytes
        self._handle = handle
        self._ptr = ptr
        self._lock = threading.Lock()

    @classmethod
    def allocate(cls, ordinal: int, nbytes: int) -> "DeviceMemory":
        """New memory on GPU `ordinal`, `nbytes` rounded up to the granularity."""
        gran = granularity(ordinal)
        nbytes = -(-nbytes // gran) * gran
        handle = ctypes.c_ulonglong()
        prop = _prop(ordinal)
        _drv().call(
            "cuMemCreate",
            ctypes.byref(handle),
            ctypes.c_size_t(nbytes),
            ctypes.byref(prop),
            ctypes.c_ulonglong(0),
        )
        return cls._mapped(ordinal, nbytes, handle.value)

    @classmethod
    def import_fd(cls, fd: int, nbytes: int, ordinal: int) -> "DeviceMemory":
        """Map the allocation behind descriptor `fd` (the caller keeps and closes it), its
        first `nbytes` (a multiple of the granularity, at most its size: the driver refuses
        more), with access for GPU `ordinal`."""
        gran = granularity(ordinal)
        if nbytes <= 0 or nbytes % gran:
            raise InvalidArgument(
                f"device staging of {nbytes} bytes is not a positive multiple of the GPU's "
                f"{gran}-byte allocation granularity"
            )
        handle = ctypes.c_ulonglong()
        _drv().call(
            "cuMemImportFromShareableHandle",
            ctypes.byref(handle),
            ctypes.c_void_p(fd),
            _CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        )
        return cls._mapped(ordinal, nbytes, handle.value)

    @classmethod
    def _mapped(cls, ordinal: int, nbytes: int, handle: int) -> "DeviceMemory":
        d = _drv()
        ptr = ctypes.c_ulonglong()
        size = ctypes.c_size_t(nbytes)
        try:
            d.call(
                "cuMemAddressReserve",
                ctypes.byref(ptr),
                size,
                ctypes.c_size_t(0),  # alignment: the granularity
                ctypes.c_ulonglong(0),  # no fixed address
                ctypes.c_ulonglong(0),
            )
        except FailedPrecondition:
            d.call("cuMemRelease", ctypes.c_ulonglong(handle))
            raise
        try:
            d.call(
                "cuMemMap", ptr, size, ctypes.c_size_t(0), ctypes.c_ulonglong(handle),
                ctypes.c_ulonglong(0),
            )  # fmt: skip
            try:
                access = _AccessDesc(
                    _Location(_CU_MEM_LOCATION_TYPE_DEVICE, ordinal),
                    _CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
                )
                d.call("cuMemSetAccess", ptr, size, ctypes.byref(access), ctypes.c_size_t(1))
            except FailedPrecondition:
                d.call("cuMemUnmap", ptr, size)
                raise
        except FailedPrecondition:
            d.call("cuMemAddressFree", ptr, size)
            d.call("cuMemRelease", ctypes.c_ulonglong(handle))
            raise
        return cls(ordinal, nbytes, handle, ptr.value)

    def export_fd(self) -> int:
        """A new descriptor for this memory, to hand to another process (close it after)."""
        fd = ctypes.c_int(-1)
        _drv().call(
            "cuMemExportToShareableHandle",
            ctypes.byref(fd),
            ctypes.c_ulonglong(self._handle),
            _CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            ctypes.c_ulonglong(0),
        )
        return fd.value

    @property
    def __cuda_array_interface__(self) -> dict:
        if not self._ptr:
            raise InvalidArgument("device memory already released")
        return {
            "shape": (self.nbytes,),
            "typestr": "|u1",
            "data": (self._ptr, False),
            "version": 2,
        }

    def tensor(self) -> torch.Tensor:
        """The memory as a 1-D uint8 tensor on its GPU (no copy; it keeps this alive)."""
        return torch.as_tensor(self, device=torch.device("cuda", self.ordinal))

    def close(self) -> None:
        """Unmap and release now (only once no tensor over it is in use)."""
        with self._lock:
            if not self._ptr:
                return
            ptr, self._ptr = self._ptr, 0
            d = _drv()
            size = ctypes.c_size_t(self.nbytes)
            d.call("cuMemUnmap", ctypes.c_ulonglong(ptr), size)
            d.call("cuMemAddressFree", ctypes.c_ulonglong(ptr), size)
            d.call("cuMemRelease", ctypes.c_ulonglong(self._handle))

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown, driver gone
            pass
