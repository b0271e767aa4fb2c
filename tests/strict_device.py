"""A strict stand-in for CuPy, for CI machines without a GPU: arrays that live "on the device" in name only.

`StrictDevice()` is an array module (`xp`) shaped like `cupy`. Its `ndarray` (`DeviceArray`) keeps a
NumPy array inside but behaves like a CuPy array at the border between host and device:

- no implicit conversion to NumPy: `np.asarray(d)`, `np.array(d)`, `float(d)`, `int(d)`, `bool(d)`,
  `operator.index(d)`, `d.tolist()`, `d.tobytes()`, `memoryview(d)`, pickling, and indexing a host
  array with a device array all raise `ImplicitTransferError` (CuPy raises TypeError on most of
  these; it converts size-1 arrays for float/int/bool with a hidden synchronisation, which the
  stand-in refuses as well, so that no per-token sync slips into the package);
- no mixing: an operation or `xp.` function given a device array and a host `np.ndarray` raises
  `HostDeviceMixError` (CuPy: "Unsupported type <class 'numpy.ndarray'>"); so does `d[...] = host`
  (CuPy refuses a non-scalar NumPy value for a basic slice); NumPy and Python scalars are fine, as
  on CuPy;
- NumPy functions and ufuncs called on device arrays only dispatch to the stand-in, as CuPy's
  `__array_function__` / `__array_ufunc__` do, and return device arrays;
- transfers are counted (`xp.transfers`): "h2d" for `xp.asarray` / `xp.array` of host data and
  `d.set(host)`, "d2h" for `xp.asnumpy` / `d.get()` / `d.item()`, "h2d_implicit" for a host index
  array or list inside `d[...]` (CuPy copies it to the device), "sync" for a gather by a boolean device
  mask (`d[mask]`) and for `xp.flatnonzero` / `nonzero` / `argwhere` / `unique` (CuPy reads a count back to
  size the result), and the bytes each way.
  `xp.counting()` gives the counts of a block.

Like CuPy: reductions return 0-d device arrays, argsort/sort are stable. What it cannot show: anything
about real device kernels (speed, float32 sums in another order, memory). It is not a GPU run.
"""

from __future__ import annotations

import contextlib
import types

import numpy as np


class ImplicitTransferError(TypeError):
    """A device array was converted to a host value without `.get()` / `xp.asnumpy`."""


class HostDeviceMixError(TypeError):
    """A host NumPy array and a device array met in one operation."""


def _implicit(what: str):
    raise ImplicitTransferError(f"strict device: implicit conversion of a device array to the host ({what}) is not "
                                "allowed; use xp.asnumpy(a) or a.get() (as on CuPy)")


def _mix(a, where: str):
    raise HostDeviceMixError(f"strict device: a host {type(a).__name__} {getattr(a, 'shape', '')} was given to {where} "
                             "together with device arrays; move it with xp.asarray first (CuPy: Unsupported type "
                             "<class 'numpy.ndarray'>)")


def _unwrap(x, where: str):
    """Device array -> its storage; host ndarray -> error; sequences element-wise; scalars as they are."""
    t = type(x)
    if t is DeviceArray:
        return x._a
    if isinstance(x, np.ndarray):
        _mix(x, where)
    if t is list or t is tuple:
        return t(_unwrap(v, where) for v in x)
    return x


def _wrap(r):
    if type(r) is np.ndarray:
        return DeviceArray(r)
    if isinstance(r, np.generic):  # CuPy returns 0-d arrays where NumPy returns scalars
        return DeviceArray(np.asarray(r))
    if type(r) is tuple or type(r) is list:
        return type(r)(_wrap(v) for v in r)
    return r


class DeviceArray:
    """A CuPy-like array whose storage is a host NumPy array that it never hands out implicitly."""

    __slots__ = ("_a", "__weakref__")
    __array_priority__ = 100.0
    __hash__ = None

    def __init__(self, a: np.ndarray):
        self._a = a

    # ---------------------------------------------------------------- the border
    def __array__(self, dtype=None, copy=None):
        _implicit("__array__, e.g. np.asarray / np.array")

    def __float__(self):
        _implicit("float()")

    def __int__(self):
        _implicit("int()")

    def __bool__(self):
        _implicit("bool(), e.g. `if a:`")

    def __index__(self):
        _implicit("operator.index(), e.g. indexing a host array or range()")

    def __complex__(self):
        _implicit("complex()")

    def __format__(self, spec):
        _implicit("format(), e.g. an f-string")

    def tolist(self):
        _implicit(".tolist()")

    def tobytes(self, *a, **k):
        _implicit(".tobytes()")

    def __reduce_ex__(self, protocol):
        _implicit("pickle")

    def __buffer__(self, flags):
        _implicit("the buffer protocol (memoryview)")

    @property
    def __array_interface__(self):
        _implicit("__array_interface__")

    @property
    def data(self):
        _implicit(".data")

    def get(self, stream=None, order="C", out=None):
        """Device -> host copy (counted)."""
        _count("d2h", self._a.nbytes)
        if out is not None:
            out[...] = self._a
            return out
        return np.array(self._a, order=order, copy=True)

    def set(self, arr, stream=None):
        """Host -> device copy into this array (counted)."""
        if type(arr) is DeviceArray:
            raise TypeError("DeviceArray.set: expected a host numpy.ndarray, got a device array")
        arr = np.asarray(arr)
        _count("h2d", arr.nbytes)
        self._a[...] = arr

    def item(self, *args):
        _count("d2h", self._a.itemsize)
        return self._a.item(*args)

    def __repr__(self):  # no values: showing them would be a transfer
        return f"DeviceArray(shape={self._a.shape}, dtype={self._a.dtype})"

    __str__ = __repr__

    # ---------------------------------------------------------------- attributes
    shape = property(lambda self: self._a.shape)

    @shape.setter
    def shape(self, value):
        self._a.shape = value

    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    T = property(lambda self: DeviceArray(self._a.T))
    real = property(lambda self: DeviceArray(self._a.real))
    imag = property(lambda self: DeviceArray(self._a.imag))
    base = property(lambda self: None if self._a.base is None else DeviceArray(np.asarray(self._a.base)))
    device = property(lambda self: "strict stand-in device")

    def __len__(self):
        return len(self._a)

    def __iter__(self):
        return (_wrap(r) for r in self._a)

    def __copy__(self):
        return DeviceArray(self._a.copy())

    def __deepcopy__(self, memo):
        return DeviceArray(self._a.copy())

    # ---------------------------------------------------------------- indexing
    @staticmethod
    def _key(key):
        parts = key if type(key) is tuple else (key,)
        out = []
        for s in parts:
            if type(s) is DeviceArray:
                s = s._a
            elif isinstance(s, np.ndarray) or type(s) is list:
                s = np.array(s)
                _count("h2d_implicit", s.nbytes)  # CuPy copies a host index to the device
            out.append(s)
        return tuple(out) if type(key) is tuple else out[0]

    def __getitem__(self, key):
        k = self._key(key)
        if any(getattr(part, "dtype", None) == np.bool_ for part in (k if type(k) is tuple else (k,))):
            _count("sync", 0)  # CuPy sizes a boolean-mask gather by a count it reads back: a device sync
        return _wrap(self._a[k])

    def __setitem__(self, key, value):
        if isinstance(value, np.ndarray) or type(value) is list:
            _mix(value, "d[...] = value")
        self._a[self._key(key)] = _unwrap(value, "d[...] = value")

    # ---------------------------------------------------------------- NumPy protocols (as CuPy: device only)
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        where = f"numpy.{ufunc.__name__}"
        ins = _unwrap(inputs, where)
        out = kwargs.get("out")
        if out is not None:
            kwargs["out"] = _unwrap(out, where)
        r = getattr(ufunc, method)(*ins, **kwargs)
        if out is not None:
            return out[0] if len(out) == 1 else out
        return _wrap(r)

    def __array_function__(self, func, types_, args, kwargs):
        where = f"numpy.{func.__name__}"
        return _wrap(func(*_unwrap(args, where), **{k: _unwrap(v, where) for k, v in kwargs.items()}))

    # ---------------------------------------------------------------- methods (CuPy's ndarray has these)
    def argsort(self, axis=-1, kind=None):
        return DeviceArray(self._a.argsort(axis=axis, kind="stable"))

    def sort(self, axis=-1, kind=None):
        self._a.sort(axis=axis, kind="stable")


_METHODS = ("all", "any", "argmax", "argmin", "argpartition", "astype", "clip", "conj", "copy", "cumprod", "cumsum",
            "diagonal", "dot", "fill", "flatten", "max", "mean", "min", "nonzero", "partition", "prod", "put",
            "ravel", "repeat", "reshape", "round", "squeeze", "std", "sum", "swapaxes", "take", "trace", "transpose",
            "var", "view")


def _method(name):
    def m(self, *args, **kwargs):
        where = f"DeviceArray.{name}"
        r = getattr(self._a, name)(*_unwrap(args, where), **{k: _unwrap(v, where) for k, v in kwargs.items()})
        out = kwargs.get("out")
        return out if out is not None else _wrap(r)

    m.__name__ = name
    return m


for _name in _METHODS:
    setattr(DeviceArray, _name, _method(_name))


def _binary(name):
    def op(self, other):
        if isinstance(other, np.ndarray):
            _mix(other, f"DeviceArray.{name}")
        r = getattr(self._a, name)(_unwrap(other, name))
        return r if r is NotImplemented else _wrap(r)

    op.__name__ = name
    return op


def _inplace(name):
    def op(self, other):
        if isinstance(other, np.ndarray):
            _mix(other, f"DeviceArray.{name}")
        getattr(self._a, name)(_unwrap(other, name))
        return self

    op.__name__ = name
    return op


for _op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor", "lshift", "rshift"):
    setattr(DeviceArray, f"__{_op}__", _binary(f"__{_op}__"))
    setattr(DeviceArray, f"__r{_op}__", _binary(f"__r{_op}__"))
    setattr(DeviceArray, f"__i{_op}__", _inplace(f"__i{_op}__"))
for _op in ("lt", "le", "gt", "ge", "eq", "ne"):
    setattr(DeviceArray, f"__{_op}__", _binary(f"__{_op}__"))
for _op in ("neg", "pos", "abs", "invert"):
    setattr(DeviceArray, f"__{_op}__", (lambda n: lambda self: DeviceArray(getattr(self._a, n)()))(f"__{_op}__"))


_COUNTS = {"h2d": 0, "d2h": 0, "h2d_implicit": 0, "sync": 0, "h2d_bytes": 0, "d2h_bytes": 0}


def _count(kind: str, nbytes: int) -> None:
    _COUNTS[kind] += 1
    _COUNTS["d2h_bytes" if kind == "d2h" else "h2d_bytes"] += int(nbytes)


_SIZED_BY_DATA = ("flatnonzero", "nonzero", "argwhere", "unique")  # CuPy reads a count back to size the result


def _function(name, f):
    def fn(*args, **kwargs):
        where = f"xp.{name}"
        if name in _SIZED_BY_DATA:
            _count("sync", 0)
        r = f(*_unwrap(args, where), **{k: _unwrap(v, where) for k, v in kwargs.items()})
        out = kwargs.get("out")
        return out if out is not None else _wrap(r)

    fn.__name__ = name
    return fn


class _Namespace(types.ModuleType):
    """numpy's functions (or a submodule's), taking and returning device arrays."""

    def __init__(self, name, source):
        super().__init__(name)
        self._source = source

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        attr = getattr(self._source, name)
        if isinstance(attr, type):  # dtypes, finfo, ...: the same objects as NumPy's (as on CuPy)
            value = attr
        elif isinstance(attr, types.ModuleType):
            value = _Namespace(f"{self.__name__}.{name}", attr)
        elif callable(attr):
            value = _function(name, attr)
        else:
            value = attr
        setattr(self, name, value)
        return value


class StrictDevice(_Namespace):
    """The stand-in array module: `cupy`'s surface over NumPy storage, strict at the host border."""

    ndarray = DeviceArray
    ImplicitTransferError = ImplicitTransferError
    HostDeviceMixError = HostDeviceMixError

    def __init__(self):
        super().__init__("strict_device", np)

    # ---------------------------------------------------------------- transfers
    @property
    def transfers(self) -> dict:
        """{"h2d", "d2h", "h2d_implicit", "sync"}: transfers (and boolean-mask syncs) since the module was imported,
        and "h2d_bytes", "d2h_bytes" (the implicit ones included) (a copy)."""
        return dict(_COUNTS)

    @contextlib.contextmanager
    def counting(self):
        """`with xp.counting() as n:` -> n holds the transfers made inside the block (filled at its end)."""
        before, n = dict(_COUNTS), {}
        try:
            yield n
        finally:
            n.update({k: _COUNTS[k] - before[k] for k in _COUNTS})

    def asarray(self, a, dtype=None, order=None, *, blocking=False):
        if type(a) is DeviceArray:
            return a if dtype is None or np.dtype(dtype) == a.dtype else DeviceArray(a._a.astype(dtype))
        out = np.array(a, dtype=dtype, order="C" if order in (None, "K", "A") else order, copy=True)
        _count("h2d", out.nbytes)
        return DeviceArray(out)

    def array(self, a, dtype=None, copy=True, order="K", ndmin=0, *, blocking=False):
        if type(a) is DeviceArray:
            return DeviceArray(np.array(a._a, dtype=dtype, copy=copy, order=order, ndmin=ndmin))
        out = np.array(a, dtype=dtype, copy=True, order=order, ndmin=ndmin)
        _count("h2d", out.nbytes)
        return DeviceArray(out)

    def asnumpy(self, a, stream=None, order="C", out=None, *, blocking=True):
        if type(a) is DeviceArray:
            return a.get(order=order, out=out)
        return np.asarray(a, order=order)

    def get_array_module(self, *args):
        return self if any(type(a) is DeviceArray for a in args) else np

    def argsort(self, a, axis=-1, kind=None):
        return DeviceArray(np.argsort(_unwrap(a, "xp.argsort"), axis=axis, kind="stable"))

    def sort(self, a, axis=-1, kind=None):
        return DeviceArray(np.sort(_unwrap(a, "xp.sort"), axis=axis, kind="stable"))

    def isscalar(self, a):
        return np.isscalar(a)

    def is_available(self):
        return True
