"""``pp.DDP`` of a torch module is itself a ``torch.nn.Module``, as torch's ``DistributedDataParallel`` is.

Code written for torch's wrapper checks ``isinstance(model, nn.Module)``, registers hooks on it, walks
``model.named_modules()``, hands it to ``torch.distributed.checkpoint.state_dict.get_state_dict(model, opt)``
or keeps it as a child of a larger module. The wrapper made here (``module_view_class(DDP)``, chosen by
``DDP.__new__`` for a torch module) is a view of its module in ``nn.Module``'s own terms: its parameters,
buffers and children *are* the module's (the same dicts), so every name it gives (``named_parameters``,
``named_buffers``, ``named_modules``, ``state_dict``, a parent's keys) is the module's own name, without
torch DDP's ``module.`` prefix, as pp.DDP's ``state_dict`` has always been. Calling it goes through
``nn.Module.__call__`` (the wrapper's forward and backward hooks run around pp.DDP's forward); attributes
that are neither the wrapper's nor ``nn.Module``'s are the module's (``model.config``, ``model.generate``).
Moving or casting the wrapper (``to``, ``cuda``, ``float``, ...) is refused: move the module before wrapping (a
``to`` or ``cpu`` that changes nothing returns the wrapper).
"""

from __future__ import annotations

from typing import Any, cast

from paramplane.parallel.torch_params import MOVES, module_attribute, refuse_move

_CLASSES: dict[type, type] = {}
SHARED = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")
"""``nn.Module``'s stores that the view shares with its module."""


def module_view_class(wrapper: type) -> type:
    """``wrapper`` (a class whose instances hold their torch module in ``.module``) mixed with
    ``torch.nn.Module`` as described in the module docstring; made once per class, when a torch module is first
    wrapped (torch stays an optional dependency)."""
    cls = _CLASSES.get(wrapper)
    if cls is None:
        import torch

        cls = _CLASSES[wrapper] = type(
            f"Torch{wrapper.__name__}",
            (ModuleView, wrapper, torch.nn.Module),
            {
                "__module__": wrapper.__module__,
                "__doc__": wrapper.__doc__,
                "__call__": torch.nn.Module.__call__,
                **{name: _refused(name) for name in MOVES - {"to", "cpu"}},
                "to": _to,  # the two that may change nothing
                "cpu": _cpu,
            },
        )
    return cls


class ModuleView:
    """The ``torch.nn.Module`` side of a wrapper (see the module docstring); first in its class's bases."""

    module: Any

    def __init__(self, module: Any, *args: Any, **kwargs: Any) -> None:
        import torch

        torch.nn.Module.__init__(cast(Any, self))
        state = vars(self)
        for name in SHARED:
            state[name] = vars(module)[name]
        state["training"] = module.training
        super().__init__(module, *args, **kwargs)  # type: ignore[call-arg]  # the wrapper's, next in the class

    def __setattr__(self, name: str, value: Any) -> None:
        # The wrapper's own attributes (``module`` first): nn.Module's would register a module or a parameter
        # value in the shared stores, i.e. in the wrapped module.
        object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        import torch

        try:
            return torch.nn.Module.__getattr__(cast(Any, self), name)
        except AttributeError:
            return module_attribute(self, name)

    def train(self, mode: bool = True) -> Any:
        self.module.train(mode)
        self.training = mode
        return self

    def apply(self, fn: Any) -> Any:
        """``fn`` on every module of the wrapped one (its root included, as on the module); returns the wrapper."""
        self.module.apply(fn)
        return self

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        refuse_move(self, "_apply")


def _to(self: Any, *args: Any, **kwargs: Any) -> Any:
    """``to(...)`` that changes nothing (the tensors are on that device, in that dtype) returns the wrapper, as
    on torch's DDP; any real move or cast is refused."""
    import torch

    device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    return _unmoved(self, "to", device, dtype, memory_format)


def _cpu(self: Any) -> Any:
    import torch

    return _unmoved(self, "cpu", torch.device("cpu"), None, None)


def _unmoved(view: Any, name: str, device: Any, dtype: Any, memory_format: Any) -> Any:
    tensors = [*view.module.parameters(), *view.module.buffers()]
    if memory_format is None and all(
        (device is None or t.device == device)
        and (dtype is None or not (t.is_floating_point() or t.is_complex()) or t.dtype == dtype)
        for t in tensors
    ):
        return view
    refuse_move(view, name)


def _refused(name: str) -> Any:
    def move(self: Any, *args: Any, **kwargs: Any) -> Any:
        refuse_move(self, name)

    move.__name__ = name
    return move
