"""A faster Triton interpreter for the test processes: device-function calls stop re-patching
``triton.language`` while a launch has already patched it, and ``tl.reduce`` with a combine
function runs a slice at a time.

Why: Triton 3.9's interpreter (``triton/runtime/interpreter.py``) patches ``triton.language``'s
builtins once per launch (``GridExecutor.__call__``) and then *again at every call of a
``@triton.jit`` helper* from inside the kernel (``InterpretedFunction.__call__``: an
``inspect.getmembers`` of ``tl``, ``tl.tensor`` and ``tl.math`` each time). Our kernels call
small helpers (``finite``, ``shift2``, ``_load_logits``, ...) in every block of every row:
profiled, the re-patching was ~45% of the interpreted kernels' time (20 of 45 s of
``lossparity --full``).

A second slowness: a ``tl.reduce`` with a combine function of ours (reverse KL's pivot and
sums) runs the combine once per *element* in Python (``ReduceOps.generic_reduce``); the shortcut
runs it once per slice along the reduced axis, the same combines in the same order for every
output element (0, 1, 2, ... along the axis), so the same bits. With both, the interpreted reverse
KL cases of test_rounding_16bit went from ~18 s to ~3 s each.

The re-patching is idempotent: it installs the same wrappers over the same module objects that
the launch already patched (and the launch's own scope restores the originals at its end), so a
device call made inside a launch skips it once the modules the helper sees have been patched in
that launch (by the launch itself, or by an earlier device call: ``tl.max`` and ``tl.sum`` see
``tl.core``). Outside a launch, and at a launch's first device call that sees another module, the
interpreter's own code runs unchanged. Only the test processes install this (conftest.py, when
``TRITON_INTERPRET=1``); the library never patches Triton. parity_tests/test_triton_interpreter_patch.py
checks that kernels (and a float32 ``tl.reduce`` of sums whose order shows in the bits) give the
same bits with it and without it.

Two caches of pure functions of types come with it (:func:`_install_type_caches`): every interpreted
operation makes ``tl.tensor`` objects, and each ``tl.tensor.__init__`` built its shape's
``tl.tuple`` type anew (``_type_for_tuple_values``: eight million calls in
test_torchloss_triton_kernels.py), and each load, store and cast looked its NumPy dtype up by
building a dict of every type (``interpreter._get_np_dtype``, a million calls). Cached per shape
and per dtype: that file took 61.4 s instead of 64.0 in one process, back to back (a subset of it
9.0-9.4 s against 10.0-10.4, twice each; this machine's noise is of that order). The replacement ``__init__``
sets the same attributes to equal values; :func:`install` compares it with Triton's own on a
sample tensor and leaves ``tl.tensor`` alone where they differ (another Triton). And a binary
operation whose operands need no conversion skips Triton's type checks
(:func:`_install_binary_fast_path`: a Triton file's interpreted cases in 42-46 s instead of 50).
"""

from __future__ import annotations

import builtins
import functools
import inspect
import math
import threading
from typing import Any, Callable

import numpy as np

_state = threading.local()
# The attribute of InterpretedFunction that holds the interpreter's own methods while installed.
INSTALLED_FLAG = "_parity_tests_skip_repeated_patching"


_LANGS: dict[Callable[..., Any], frozenset[int]] = {}


def _lang_modules(fn: Callable[..., Any], tl: Any) -> frozenset[int]:
    """The ids of the ``triton.language`` modules ``fn`` sees (what ``_patch_lang`` patches),
    once per function (a module's imports do not change)."""
    langs = _LANGS.get(fn)
    if langs is None:
        langs = _LANGS[fn] = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
    return langs


def _shaped(data: Any, shape: tuple[int, ...]) -> Any:
    """A combine's result as an array of the reduction's output shape (a scalar tensor's data
    has shape ``(1,)``; a Python number broadcasts)."""
    if data.size == int(np.prod(shape)):
        return data.reshape(shape)
    return np.broadcast_to(data, shape)


def install() -> bool:
    """Install the shortcut into Triton's interpreter (idempotent). False where this Triton's
    interpreter does not have the expected shape (the interpreter then runs unchanged)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    grid_executor = getattr(interpreter, "GridExecutor", None)
    interpreted = getattr(interpreter, "InterpretedFunction", None)
    if grid_executor is None or interpreted is None or not hasattr(interpreter, "_patch_lang"):
        return False
    if getattr(interpreted, INSTALLED_FLAG, False):
        return True
    launch = grid_executor.__call__
    device_call = interpreted.__call__

    @functools.wraps(launch)
    def patched_launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        outer = getattr(_state, "patched", None)
        _state.patched = _lang_modules(self.fn, tl)
        try:
            return launch(self, *args, **kwargs)
        finally:
            _state.patched = outer

    @functools.wraps(device_call)
    def patched_device_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        patched = getattr(_state, "patched", None)
        if patched is None:
            return device_call(self, *args, **kwargs)
        langs = _lang_modules(self.fn, tl)
        if not langs <= patched:
            # The first call that sees another module (triton.language.standard's tl.max and
            # tl.sum see tl.core) patches it the interpreter's way; the launch remembers it.
            _state.patched = patched | langs
            return device_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    reduce_ops = getattr(interpreter, "ReduceOps", None)
    generic = getattr(reduce_ops, "generic_reduce", None)

    @functools.wraps(generic)
    def sliced_generic_reduce(self: Any, input: Any) -> Any:
        """``ReduceOps.generic_reduce`` (a ``tl.reduce`` with a combine function) one slice along
        the axis at a time instead of one element: the same combines in the same order for every
        output element (index 0, then 1, 2, ... along the axis, the accumulator kept in the
        input's dtype between steps), the elements of a slice at once."""
        original_axis = self.axis
        input, axis = self.unravel(input, self.axis)
        datas = [arg.handle.data for arg in input]
        dtypes = [arg.dtype for arg in input]
        input_shape = datas[0].shape
        output_shape = input_shape[0:axis] + input_shape[axis + 1:]
        acc = [np.array(np.take(d, 0, axis=axis), dtype=d.dtype) for d in datas]
        for k in range(1, input_shape[axis]):
            acc_tensors = tuple(self.to_tensor(a, dt) for a, dt in zip(acc, dtypes))
            item_tensors = tuple(self.to_tensor(np.array(np.take(d, k, axis=axis), dtype=d.dtype), dt) for d, dt in zip(datas, dtypes))
            out = self.combine_fn.fn(*acc_tensors, *item_tensors)
            out = out if isinstance(out, tuple) else (out,)
            acc = [_shaped(np.asarray(o.handle.data if isinstance(o, tl.core.tensor) else o), output_shape).astype(d.dtype)
                   for o, d in zip(out, datas)]
        ret = []
        for data, dt in zip(acc, dtypes):
            if self.keep_dims:
                if original_axis is not None:
                    data = np.expand_dims(data, axis)
                else:
                    for _ in range(len(input_shape)):
                        data = np.expand_dims(data, 0)
            elif original_axis is None:
                data = data.item()
            ret.append(self.to_tensor(data, dt))
        return ret

    grid_executor.__call__ = patched_launch
    interpreted.__call__ = patched_device_call
    if generic is not None:
        reduce_ops.generic_reduce = sliced_generic_reduce
    setattr(interpreted, INSTALLED_FLAG,
            (launch, device_call, generic, _install_type_caches(interpreter), _install_binary_fast_path(interpreter)))
    return True


def _install_type_caches(interpreter: Any) -> tuple[Any, Any]:
    """Cache ``interpreter._get_np_dtype`` per dtype and the shape types of ``tl.tensor.__init__``
    (see the module docstring). Returns the originals ``(get_np_dtype, tensor_init)`` for
    :func:`uninstall`; a ``tensor_init`` of ``None`` where Triton's own ``__init__`` does not give the
    attributes that the cached one gives (left alone)."""
    from triton.language import core

    get_np_dtype = interpreter._get_np_dtype
    np_dtypes: dict[Any, Any] = {}

    @functools.wraps(get_np_dtype)
    def cached_np_dtype(tt_dtype: Any) -> Any:
        try:
            found = np_dtypes.get(tt_dtype)
        except TypeError:  # block types are not hashable: their scalar decides, uncached
            return get_np_dtype(tt_dtype)
        if found is None:
            found = np_dtypes[tt_dtype] = get_np_dtype(tt_dtype)
        return found

    interpreter._get_np_dtype = cached_np_dtype
    tensor_init = core.tensor.__init__
    shape_types: dict[tuple[int, ...], Any] = {}
    constexpr = core.constexpr

    def cached_init(self: Any, handle: Any, type: Any) -> None:
        shape = builtins.tuple(type.shape) if type.is_block() else ()
        self.handle = handle
        self.numel = constexpr(math.prod(shape))
        self.type = type
        self.dtype = type.scalar
        values = [constexpr(size) for size in shape]
        shape_type = shape_types.get(shape)
        if shape_type is None:
            shape_type = shape_types[shape] = core._type_for_tuple_values(values)
        self.shape = core.tuple(values, shape_type)

    if not _same_tensor(core, tensor_init, cached_init):
        return get_np_dtype, None
    core.tensor.__init__ = cached_init
    return get_np_dtype, tensor_init


def _install_binary_fast_path(interpreter: Any) -> Any:
    """Give the interpreter's ``TritonSemantic`` instance a shortcut for the type checks of a
    binary operation whose operands need no conversion. Returns what to restore for
    :func:`uninstall` (``None``: the interpreter has no such instance; nothing installed).

    ``binary_op_type_checking_impl`` (every ``+``, ``*``, ``<``, ``&``, ... of a kernel: 40% of the
    interpreted kernels' time) computes the operation's type, casts both operands to it and
    broadcasts them. Two cases skip most of that and return what it returns:

    * two tensors of one scalar type out of float32, float64, int64, int32 and int1 (the same
      object: ``tl.float32`` etc.) and of one shape (both blocks of equal shapes, or both
      scalars): the computation type is that type (for float32 and float64 with ``/`` and ``%``
      too; integers of one signedness promote to themselves), a cast to its own type and a
      broadcast between equal shapes return their operand, so the operands come back as they were;
    * a float32 tensor and a Python ``float``: the scalar does not take part in the promotion
      (a float is of no higher kind than a float32 tensor), so the computation type is float32;
      the float becomes ``scalar_constant(value, float32)`` and is broadcast to the tensor, as in
      Triton's own code (which follows the same steps after its checks).

    Everything else (pointers, 16-bit floats, mixed types or shapes, Python ints, which are range
    checked) takes Triton's own path.
    """
    semantic = getattr(interpreter, "interpreter_semantic", None)
    if semantic is None or not hasattr(semantic, "binary_op_type_checking_impl"):
        return None
    import triton.language as tl

    own = semantic.binary_op_type_checking_impl  # the bound method
    tensor, block_type, float32 = tl.core.tensor, tl.core.block_type, tl.float32
    same_type_ok = (tl.float32, tl.float64, tl.int64, tl.int32, tl.int1)

    def binary_op_type_checking_impl(lhs: Any, rhs: Any, allow_lhs_ptr: bool = False, allow_rhs_ptr: bool = False,
                                     arithmetic_check: bool = True, div_or_mod: bool = False) -> Any:
        lhs_tensor, rhs_tensor = lhs.__class__ is tensor, rhs.__class__ is tensor
        if lhs_tensor and rhs_tensor:
            lt, rt = lhs.type, rhs.type
            if lt.__class__ is block_type and rt.__class__ is block_type:
                if lt.element_ty is rt.element_ty and lt.shape == rt.shape and any(lt.element_ty is t for t in same_type_ok):
                    return lhs, rhs
            elif lt is rt and any(lt is t for t in same_type_ok):
                return lhs, rhs
        elif arithmetic_check and lhs_tensor and rhs.__class__ is float and lhs.dtype is float32:
            return semantic.broadcast_impl_value(lhs, semantic.scalar_constant(rhs, dtype=float32))
        elif arithmetic_check and rhs_tensor and lhs.__class__ is float and rhs.dtype is float32:
            return semantic.broadcast_impl_value(semantic.scalar_constant(lhs, dtype=float32), rhs)
        return own(lhs, rhs, allow_lhs_ptr, allow_rhs_ptr, arithmetic_check, div_or_mod)

    semantic.binary_op_type_checking_impl = binary_op_type_checking_impl
    return semantic


def _same_tensor(core: Any, own: Callable[..., None], cached: Callable[..., None]) -> bool:
    """Whether ``cached`` gives a sample block tensor the attributes ``own`` gives it."""

    def attributes(init: Callable[..., None]) -> Any:
        value = core.tensor.__new__(core.tensor)
        init(value, None, core.block_type(core.float32, [2, 8]))
        shape_type = vars(value.shape.type)  # a tuple_type: no repr of its own
        return {name: repr(v) for name, v in vars(value).items()} | {"shape type": repr(shape_type)}

    try:
        return attributes(own) == attributes(cached)
    except Exception:  # noqa: BLE001 - another Triton: leave its tensor alone
        return False


def uninstall() -> None:
    """Put the interpreter's own methods back (for the equivalence test)."""
    from triton.runtime import interpreter

    originals = getattr(interpreter.InterpretedFunction, INSTALLED_FLAG, None)
    if not originals:
        return
    interpreter.GridExecutor.__call__, interpreter.InterpretedFunction.__call__, generic, (get_np_dtype, tensor_init), semantic = originals
    if semantic is not None:
        del semantic.binary_op_type_checking_impl  # the instance attribute: the class's method again
    if generic is not None:
        interpreter.ReduceOps.generic_reduce = generic
    interpreter._get_np_dtype = get_np_dtype
    if tensor_init is not None:
        from triton.language import core

        core.tensor.__init__ = tensor_init
    delattr(interpreter.InterpretedFunction, INSTALLED_FLAG)
