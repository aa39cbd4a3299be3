"""Any user kernel declared with `tritune.tunable_kernel` as a bundle plan: `module:attribute` (or
`path/to/file.py:attribute`) names the tuned kernel; its own `inputs`, `reference`, `output` and string `grid`
make the data set and the run spec, and its search space (or a configs file) the artifacts.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from tritune.aot.plan import KernelPlan
from tritune.aot.spec import RunSpec, SpecArg, SpecTolerance
from tritune.aot.tdat import write_tensor

AOT_LAUNCH_OPTIONS = ("num_warps", "num_stages")  # what triton.tools.compile takes
_TDAT_OF = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "int32",
            torch.int64: "int64", torch.uint8: "uint8"}


def load_target(text: str) -> tuple[Any, str]:
    """`module:attribute` or `file.py:attribute` -> (object, Python source of an entry module that re-imports it
    and exposes its @triton.jit function under the function's own name, for the AOT compiler)."""
    where, sep, attr = text.rpartition(":")
    if not sep or not where or not attr.isidentifier():
        raise ValueError(f"--kernel {text!r}: expected module:attribute or path/to/file.py:attribute")
    if where.endswith(".py"):
        path = Path(where).resolve()
        if not path.is_file():
            raise ValueError(f"--kernel {text!r}: no file {path}")
        mod_name = "tritune_user_" + "".join(ch if ch.isalnum() else "_" for ch in path.stem)
        spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        spec.loader.exec_module(module)
        loader = (f"import importlib.util, sys\n"
                  f"_spec = importlib.util.spec_from_file_location({mod_name!r}, {str(path)!r})\n"
                  f"_mod = importlib.util.module_from_spec(_spec)\n"
                  f"sys.modules[{mod_name!r}] = _mod\n"
                  f"_spec.loader.exec_module(_mod)\n")
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as err:
            raise ValueError(f"--kernel {text!r}: cannot import {where!r}: {err}") from None
        loader = f"import importlib\n_mod = importlib.import_module({where!r})\n"
    if not hasattr(module, attr):
        raise ValueError(f"--kernel {text!r}: {where} has no attribute {attr!r}")
    obj = getattr(module, attr)
    from tritune.user import UserKernel

    if not isinstance(obj, UserKernel):
        raise ValueError(f"--kernel {text!r} is a {type(obj).__name__}, not a tritune.UserKernel: declare it with "
                         "tritune.tunable_kernel(inputs=..., reference=..., output=..., grid=...) so the bundle "
                         "has data to check it with")
    fn_name = obj.kernel.fn.__name__
    return obj, loader + f"{fn_name} = _mod.{attr}.kernel\n"


def _no_specialize(kernel: Any, names: tuple[str, ...]) -> tuple[str, ...]:
    out = []
    for item in getattr(kernel, "do_not_specialize", None) or ():
        out.append(names[item] if isinstance(item, int) else str(item))
    return tuple(out)


def user_plans(bundle: Path, target: str, problem: Mapping[str, Any], *, configs: list[dict] | None = None,
               seed: int = 0) -> list[KernelPlan]:
    uk, entry = load_target(target)
    if callable(uk.grid) or isinstance(uk.grid, str):
        raise ValueError(f"{uk.name}: ahead of time the grid must be expressions (a tuple of strings such as "
                         "('cdiv(N_CTX, BLOCK_SIZE_M)', 'Z * H', '1')), not a Python callable")
    grid = tuple(str(g) for g in uk.grid) + ("1",) * (3 - len(uk.grid))
    args = uk.make_args(dict(problem), torch.device("cpu"), seed)
    fn = uk.kernel.fn
    names = uk.arg_names
    chosen = [dict(c) for c in configs] if configs else [c.as_dict() for c in uk.configs(args)]
    if not chosen:
        raise ValueError(f"{uk.name}: no config survives the constraints for this problem")
    from tritune.user import LAUNCH_OPTIONS

    other = sorted({k for c in chosen for k in c if k in LAUNCH_OPTIONS and k not in AOT_LAUNCH_OPTIONS})
    if other:
        raise ValueError(f"{uk.name}: launch options {other} cannot be compiled ahead of time (only num_warps and "
                         "num_stages); fix them in the kernel or leave them out of the configs")
    space_names = set(chosen[0]) - set(AOT_LAUNCH_OPTIONS)
    key_text = uk.key_text(args)
    tag = "".join(ch if ch.isalnum() or ch in "=-" else "-" for ch in key_text.replace(",", "-"))[:120]
    (bundle / "data").mkdir(parents=True, exist_ok=True)
    spec_args, fixed = [], {}
    expected = uk.reference_fn(args)
    for name in names:
        if name in space_names:
            continue
        if name not in args:
            raise ValueError(f"{uk.name}: kernel argument {name!r} is missing from inputs()")
        value = args[name]
        if name in uk.constexpr_names:
            if isinstance(value, bool) or isinstance(value, int):
                fixed[name] = int(value)
                continue
            raise ValueError(f"{uk.name}: constexpr {name}={value!r}: only integer/bool constexprs can be compiled in")
        if isinstance(value, torch.Tensor):
            if value.dtype not in _TDAT_OF:
                raise ValueError(f"{uk.name}: tensor {name} has dtype {value.dtype}, not one of bf16/fp16/fp32/int")
            file = f"data/{name}.{tag}.tdat"
            data = expected.to(value.dtype) if name == uk.output else value
            write_tensor(bundle / file, name, data.contiguous(), {"key": key_text, "seed": seed})
            spec_args.append(SpecArg(name, "out" if name == uk.output else "in", file))
        elif isinstance(value, bool):
            raise ValueError(f"{uk.name}: runtime bool argument {name} is not supported ahead of time")
        elif isinstance(value, int):
            spec_args.append(SpecArg(name, "i32" if -(2**31) <= value < 2**31 else "i64", str(value)))
        elif isinstance(value, float):
            spec_args.append(SpecArg(name, "f32", repr(float(value))))
        else:
            raise ValueError(f"{uk.name}: argument {name}={value!r} is not a tensor, int or float")
    tol = uk.tolerance_for(args)
    spec = RunSpec(kernel=uk.name, values=(), args=tuple(spec_args), grid=grid,
                   tolerance=SpecTolerance(tol.atol, tol.rtol, tol.max_mismatch_ratio, tol.max_rel_l2))

    def artifact_id(p: Mapping[str, int]) -> str:
        return uk.name + "_" + "_".join(f"{k}{p[k]}" for k in sorted(p))

    return [KernelPlan(
        name=uk.name, entry_source=entry, function=fn.__name__, param_names=names, spec=spec, configs=chosen,
        constexprs=lambda p: fixed | {k: v for k, v in p.items() if k not in AOT_LAUNCH_OPTIONS},
        artifact_id=artifact_id, source=target, do_not_specialize=_no_specialize(uk.kernel, names),
        problem={k: str(v) for k, v in problem.items()},
        store={"kind": "user", "path": str(uk.store_path), "name": uk.name, "key_text": key_text,
               "key": {k: str(v) for k, v in uk.key_of(args).items()}})]
