"""Tracing a model's forward with ``torch.fx`` for the rules that need no layer names.

:func:`traced_graph` gives the graph the rules of :mod:`dkfac.engine.roles` read (a model
fx cannot trace, data-dependent control flow, gets none, and a model wrapped in FSDP1's
``FullyShardedDataParallel`` is not traced: its flat parameters hide the layers). A model
sharded with FSDP2's ``fully_shard`` is traced as its unsharded twin, and a part compiled
with ``torch.compile`` as the module it compiles (:class:`_UnshardedTracer`).
:func:`call_order` reads from it the order the forward calls its layers in, and
:func:`uncalled_layers` the layers whose weight the forward applies without calling them.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import warnings
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn

__all__ = [
    "Links",
    "call_order",
    "compiled_original",
    "layer_links",
    "traced_graph",
    "uncalled_layers",
    "unsharded",
    "untouched_layers",
]

logger = logging.getLogger(__name__)


def traced_graph(
    model: nn.Module,
    purpose: str,
    branch: bool | None = None,
    evaluating: bool = False,
    leaves: Collection[nn.Module] = (),
) -> fx.Graph | None:
    """The graph of ``model``'s forward, or ``None`` (logged at INFO with ``purpose``) when
    it is FSDP1-wrapped or cannot be traced. The warnings the traced forward raises are not
    shown (it runs on proxies). A model compiled whole is the caller's to
    unwrap (:func:`compiled_original`): its forward cannot be traced.

    ``branch``: every condition on a traced value (data-dependent control flow, which fx
    cannot trace) is taken as this answer, the graph then one path the forward may take (True
    for at most :data:`MAX_GUESSES` conditions, then False, so that a loop ends); ``None``:
    such a condition fails the trace. ``evaluating``: the forward of the model in eval
    mode (each module's mode restored after). ``leaves``: modules called as leaves (one
    ``call_module`` node each call) besides ``torch.nn``'s own.

    A forward that draws random numbers draws them from a fork of the CPU generator: tracing
    leaves the user's random stream as it was."""
    wrapped = [
        n for n, m in model.named_modules() if type(m).__name__ == "FullyShardedDataParallel"
    ]
    if wrapped:
        logger.info("%s: not traced (%s is FSDP1-wrapped)", purpose, wrapped[0] or "the model")
        return None
    try:
        # A symbolic run: what the forward warns of there is about proxies, not the user's
        # data (``torch.utils.checkpoint`` with ``use_reentrant=True`` warns that none of
        # its inputs requires a gradient), and the real forward warns again if it applies.
        with warnings.catch_warnings(), torch.random.fork_rng(devices=[]), _attributes_kept(model):
            warnings.simplefilter("ignore")
            kept = frozenset(map(id, leaves))
            tracer = _UnshardedTracer(kept) if branch is None else _GuessingTracer(branch, kept)
            if not evaluating:
                return tracer.trace(model)
            modes = {m: m.training for m in model.modules()}
            try:
                model.eval()
                return tracer.trace(model)
            finally:
                for module, training in modes.items():
                    module.training = training
    except Exception as error:
        logger.info("%s: %s is not traceable (%s)", purpose, type(model).__name__, error)
        return None


@contextlib.contextmanager
def _attributes_kept(model: nn.Module) -> Iterator[None]:
    """Restores, after a trace, the attributes of ``model``'s modules and of the plain
    objects they hold (a ``transformers`` model's ``config``): the forward runs on proxies,
    and what it stores is about them, not the user's data (``transformers``' classification
    loss sets ``config.problem_type`` from the labels' dtype on its first call, and a guessed
    condition would make it a multi-label loss for good)."""
    saved: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}
    for module in model.modules():
        for holder in (module, *vars(module).values()):
            if id(holder) in saved or not _plain_holder(holder, module):
                continue
            attributes = vars(holder)
            saved[id(holder)] = (attributes, dict(attributes))
    try:
        yield
    finally:
        for attributes, before in saved.values():
            changed = attributes.keys() != before.keys() or any(
                attributes[k] is not v for k, v in before.items()
            )
            if changed:
                attributes.clear()
                attributes.update(before)


def _plain_holder(holder: object, module: nn.Module) -> bool:
    """Whether :func:`_attributes_kept` keeps ``holder``'s attributes: the module itself, or
    an object of a class with an instance ``__dict__`` that is neither a module, a tensor,
    a class nor a function."""
    if holder is module:
        return True
    if isinstance(holder, (nn.Module, torch.Tensor, type)) or callable(holder):
        return False
    return isinstance(getattr(holder, "__dict__", None), dict)


def call_order(model: nn.Module, names: Sequence[str]) -> list[str] | None:
    """``names`` (qualified module names) in the order ``model``'s forward first calls
    them, read from its traced graph; ``None`` when it cannot be traced or one of them is
    not called there as a module (a layer fx traces into, or one the forward never calls)."""
    original = compiled_original(model)
    if original is not None:  # torch.compile(model): its layers are "_orig_mod.<name>"
        inner = [n.removeprefix("_orig_mod.") for n in names]
        order = (
            call_order(original, inner) if all(n.startswith("_orig_mod.") for n in names) else None
        )
        return None if order is None else [f"_orig_mod.{n}" for n in order]
    graph = traced_graph(model, "roles by call order")
    if graph is None:
        return None
    wanted = set(names)
    called = [str(n.target) for n in graph.nodes if n.op == "call_module" and n.target in wanted]
    order = list(dict.fromkeys(called))
    return order if len(order) == len(wanted) else None


@dataclasses.dataclass(frozen=True)
class Links:
    """How one layer sits in the forward's data flow among the layers asked about.

    Attributes:
        before: The other layers some input of one of its calls depends on.
        after: The other layers some call of which depends on one of its outputs.
        reads_data: Whether some call of it depends on the forward's arguments.
    """

    before: frozenset[str]
    after: frozenset[str]
    reads_data: bool


def layer_links(model: nn.Module, names: Sequence[str]) -> dict[str, Links] | None:
    """The data-flow :class:`Links` of each of ``names`` (qualified module names), read from
    ``model``'s traced graph (every call of a layer counted, a layer never its own neighbour);
    ``None`` when one of them is not called there as a module. A forward with data-dependent
    control flow is traced on two paths (:func:`traced_graph`'s ``branch`` True and False),
    its links the union of both; ``None`` when neither can be traced or some layer is on
    neither. A layer the forward never touches (not called, no parameter of it read: a
    projection head kept for another task) is left out of the answer instead, so that the
    others' links still count; one whose parameter the graph reads (its weight used
    functionally, ``F.linear(h, self.out.weight)``) makes it ``None``, its place unknown."""
    original = compiled_original(model)
    if original is not None:  # torch.compile(model): its layers are "_orig_mod.<name>"
        if not all(n.startswith("_orig_mod.") for n in names):
            return None
        inner = layer_links(original, [n.removeprefix("_orig_mod.") for n in names])
        if inner is None:
            return None

        def outer(group: frozenset[str]) -> frozenset[str]:
            return frozenset(f"_orig_mod.{n}" for n in group)

        return {
            f"_orig_mod.{n}": Links(outer(x.before), outer(x.after), x.reads_data)
            for n, x in inner.items()
        }
    graph = traced_graph(model, "roles by data flow")
    found = [] if graph is None else [_graph_links(graph, names)]
    if found and len(found[0]) == len(set(names)):
        return found[0]
    # Some layers are on no path of that trace (a branch a random draw skipped, stochastic
    # depth) or it failed (data-dependent control flow): the other paths (_other_paths); a
    # layer's links are its links on any of them (a layer on none: not known).
    paths = _other_paths(model, graph)
    found += [_graph_links(g, names) for g in paths]
    called = set().union(*(set(links) for links in found))
    untouched = _untouched_on_all(model, [g for g in (graph, *paths) if g is not None], names)
    if not found or called != set(names) - untouched:
        return None
    return {
        n: Links(
            frozenset().union(*(links[n].before for links in found if n in links)),
            frozenset().union(*(links[n].after for links in found if n in links)),
            any(links[n].reads_data for links in found if n in links),
        )
        for n in names
        if n in called
    }


def _other_paths(model: nn.Module, graph: fx.Graph | None) -> list[fx.Graph]:
    """The graphs besides ``graph`` (the forward's trace, ``None`` where it failed) that a
    layer missing from it may be on: where the trace failed (data-dependent control flow),
    the paths where the conditions hold (the first :data:`MAX_GUESSES` of them) and where
    none does; and the forward in eval mode (a branch a random draw skipped in training)."""
    paths = (
        []
        if graph is not None
        else [traced_graph(model, "roles on one path", branch) for branch in (True, False)]
    )
    paths.append(traced_graph(model, "roles in eval mode", evaluating=True))
    return [g for g in paths if g is not None]


def untouched_layers(model: nn.Module, names: Sequence[str]) -> frozenset[str]:
    """Those of ``names`` that the forward never touches on any traced path (see
    :func:`layer_links`); none where it cannot be traced at all."""
    original = compiled_original(model)
    if original is not None:  # torch.compile(model): its layers are "_orig_mod.<name>"
        if not all(n.startswith("_orig_mod.") for n in names):
            return frozenset()
        inner = untouched_layers(original, [n.removeprefix("_orig_mod.") for n in names])
        return frozenset(f"_orig_mod.{n}" for n in inner)
    graph = traced_graph(model, "layers the forward never touches")
    graphs = [g for g in (graph, *_other_paths(model, graph)) if g is not None]
    return frozenset(_untouched_on_all(model, graphs, names) if graphs else ())


def _untouched_on_all(
    model: nn.Module, graphs: Sequence[fx.Graph], names: Sequence[str]
) -> set[str]:
    """Those of ``names`` that no graph of ``graphs`` touches (:func:`_untouched` on each)."""
    return set(names).intersection(*(_untouched(model, g, names) for g in graphs))


def _untouched(model: nn.Module, graph: fx.Graph, names: Sequence[str]) -> set[str]:
    """Those of ``names`` that ``graph`` neither calls (as modules, or inside a module it
    calls as a leaf: a ``TransformerEncoderLayer``'s own layers) nor reads a parameter of
    (``get_attr``: by identity, so a weight tied to another layer's, read under that
    layer's name, counts too)."""
    called: set[str] = set()
    read: set[int] = set()
    for node in graph.nodes:
        if node.op == "call_module":
            called.add(str(node.target))
        elif node.op == "get_attr":
            held: Any = model
            for part in str(node.target).split("."):
                held = getattr(held, part, None)
            read.add(id(held))

    def touched(name: str) -> bool:
        if any(name == t or name.startswith(f"{t}.") or t.startswith(f"{name}.") for t in called):
            return True
        return any(id(p) in read for p in model.get_submodule(name).parameters())

    return {name for name in names if not touched(name)}


def _graph_links(graph: fx.Graph, names: Sequence[str]) -> dict[str, Links]:
    """The links of those of ``names`` that ``graph`` calls as modules (see
    :func:`layer_links`)."""
    wanted = set(names)
    upstream: dict[fx.Node, frozenset[str]] = {}  # the layers a node depends on
    data: dict[fx.Node, bool] = {}  # whether it depends on the forward's arguments
    before: dict[str, set[str]] = {n: set() for n in names}
    after: dict[str, set[str]] = {n: set() for n in names}
    reads = dict.fromkeys(names, False)
    for node in graph.nodes:
        inputs = node.all_input_nodes
        found = frozenset().union(*(upstream[n] for n in inputs))
        data[node] = node.op == "placeholder" or any(data[n] for n in inputs)
        layer = str(node.target) if node.op == "call_module" else None
        if layer in wanted:
            before[layer] |= found - {layer}
            reads[layer] = reads[layer] or data[node]
            for earlier in found - {layer}:
                after[earlier].add(layer)
            found = found | {layer}
        upstream[node] = found
    called = {str(n.target) for n in graph.nodes if n.op == "call_module"}
    return {
        n: Links(frozenset(before[n]), frozenset(after[n]), reads[n]) for n in names if n in called
    }


def uncalled_layers(model: nn.Module, layers: Mapping[str, nn.Module]) -> list[str]:
    """Those of ``layers`` (name -> module of ``model``) that ``model``'s forward never
    calls while it reads a parameter of theirs itself (``F.linear(h, self.head.weight)``):
    no hook of theirs runs. Read from one trace with each of them a leaf; empty where the
    forward cannot be traced in one piece (data-dependent control flow). A layer whose
    parameter another module also holds (a tied weight) is not named: the tie decides."""
    original = compiled_original(model)
    model = original if original is not None else model
    graph = traced_graph(model, "layers applied without their forward", leaves=layers.values())
    if graph is None:
        return []
    called: set[int] = set()
    read: set[int] = set()
    for node in graph.nodes:
        if node.op == "call_module":
            called.add(id(model.get_submodule(str(node.target))))
        elif node.op == "get_attr":
            with contextlib.suppress(AttributeError):
                read.add(id(model.get_parameter(str(node.target))))
    holders = collections.Counter(
        id(p) for m in model.modules() for p in m._parameters.values() if p is not None
    )
    called.add(id(model))  # the model itself: the caller's call runs its hooks
    return [
        name
        for name, module in layers.items()
        if id(module) not in called
        and any(id(p) in read for p in module.parameters(recurse=False))
        and all(holders[id(p)] == 1 for p in module.parameters(recurse=False))
    ]


def compiled_original(module: nn.Module) -> nn.Module | None:
    """The module ``torch.compile`` wrapped in ``module`` (an ``OptimizedModule``, whose
    forward fx cannot trace), or ``None`` when ``module`` is not such a wrapper."""
    original = getattr(module, "_orig_mod", None)
    compiled = type(module).__name__ == "OptimizedModule"
    return original if compiled and isinstance(original, nn.Module) else None


def unsharded(cls: type) -> type:
    """The class ``fully_shard`` derived ``cls`` from (``FSDPLinear`` -> ``nn.Linear``), or
    ``cls`` itself when it is not such a class."""
    sharded = _fsdp_module()
    if sharded is not None and issubclass(cls, sharded) and len(cls.__bases__) == 2:
        return cls.__bases__[1]
    return cls


def _fsdp_module() -> type | None:
    """FSDP2's ``FSDPModule`` (``None`` where ``torch.distributed`` is not built)."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


class _UnshardedTracer(fx.Tracer):
    """``torch.fx``'s tracer that sees a compiled part as the module it compiles, and a
    ``fully_shard`` model as the model it was made from: a sharded ``torch.nn`` layer is a
    leaf as its class would be, and a sharded module is traced through its own ``forward``,
    without the sharding's hooks (which gather parameters, and which FSDP refuses to run
    from a submodule before the root)."""

    def __init__(self, leaves: frozenset[int] = frozenset()) -> None:
        super().__init__()
        self.leaves = leaves  # ids of modules taken as leaves besides torch.nn's

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if id(m) in self.leaves:
            return True
        cls = unsharded(type(m))
        return cls.__module__.startswith(("torch.nn", "torch.ao.nn")) and not issubclass(
            cls, nn.Sequential
        )

    def call_module(
        self, m: nn.Module, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        original = compiled_original(m)
        if original is not None:  # a compiled part: traced as a call of the module it compiles
            return self.call_module(original, original.forward, args, kwargs)
        if unsharded(type(m)) is not type(m):
            forward = functools.partial(type(m).forward, m)
        return super().call_module(m, forward, args, kwargs)


MAX_GUESSES = 16
"""The conditions on traced values a guessing trace answers as asked; every later one is
answered False (a loop ``while x.norm() > tol`` answered True would never end)."""


class _GuessingTracer(_UnshardedTracer):
    """A tracer that answers every condition on a traced value with ``answer`` (see
    :func:`traced_graph`): the first :data:`MAX_GUESSES`, then False."""

    def __init__(self, answer: bool, leaves: frozenset[int] = frozenset()) -> None:
        super().__init__(leaves)
        self.answer = answer
        self.guesses = 0

    def to_bool(self, obj: fx.Proxy) -> bool:
        self.guesses += 1
        return self.answer and self.guesses <= MAX_GUESSES
