"""Builds a cache's ordered tier list from settings: the one place tiers are opened.

The order is the order of cost: L1 (resident checkpoints), L2 (RAM mirror), L3 (disk), then
every registered extra tier (a remote store, a test's in-memory tier) in registration order. A
new tier is a module that implements a protocol of :mod:`skippy_llama.tiers.base` and a factory
registered here with :func:`register`; nothing in the cache, the runtime or the server changes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..admission import AdmissionPolicy
from ..config import Settings
from ..costs import CostModel
from ..identity import CacheIdentity
from ..restore_points import PointTier, RamPoints
from .base import Tier
from .l3.tier import DiskTier
from .ram import RamTier
from .resident import ResidentIndex

log = logging.getLogger("skippy_llama")


@dataclass(frozen=True)
class TierContext:
    """What a tier factory may know about the model and context it serves.

    Attributes:
        settings: the cache settings.
        identity: the cache identity (page keys chain from ``identity.root``).
        backend: the llama.cpp backend name (``CPU``, ``CUDA`` ...).
        costs: the cache's cost model (admission weighs records with it).
        pageable: whether the context's states can be cut into pages (page tiers need it).
        unpageable_reason: why not, for the log.
        resident_slots: sequence ids free for L1 checkpoints (empty: no L1).
        l1_budget_tokens: tokens L1 may keep resident in all.
        window: the model's sliding-window size (0: none).
    """

    settings: Settings
    identity: CacheIdentity
    backend: str
    costs: CostModel
    pageable: bool
    unpageable_reason: str = ""
    resident_slots: Sequence[int] = ()
    l1_budget_tokens: int = 0
    window: int = 0


#: ``factory(context, tiers built so far) -> tier or None``.
TierFactory = Callable[[TierContext, Sequence[Tier]], Tier | None]

#: Extra tiers, built after L1/L2/L3 in this order (see :func:`register`).
EXTRA_FACTORIES: list[TierFactory] = []


def register(factory: TierFactory) -> None:
    """Add a tier factory; every cache built afterwards asks it for a tier."""
    EXTRA_FACTORIES.append(factory)


def wants_pages(settings: Settings) -> bool:
    """Whether a page tier may be built: the runtime then reads the KV layout at load."""
    return settings.l3.mode != "off" or settings.remote.enabled or bool(EXTRA_FACTORIES)


def build_tiers(context: TierContext) -> list[Tier]:
    """The cache's tiers, cheapest first. Fails open: a tier that cannot open is left out."""
    tiers: list[Tier] = []
    resident = _resident(context)
    if resident is not None:
        tiers.append(resident)
    disk = _disk(context)
    if disk is not None:
        l2 = context.settings.l2.budget
        if l2:
            ram = RamTier(l2, source=disk)
            disk.add_removal_listener(ram.invalidate)
            tiers.append(ram)
        tiers.append(disk)
    remote = _remote(context, disk)
    if remote is not None:
        tiers.append(remote)
    for factory in EXTRA_FACTORIES:
        tier = factory(context, tuple(tiers))
        if tier is not None:
            tiers.append(tier)
    return tiers


def build_point_tiers(settings: Settings) -> list[PointTier]:
    """The tiers that keep restore points beyond the live process (recurrent, hybrid and
    sliding-window models, whose prefixes are not pageable), cheapest first: L2 (``l2.budget``,
    a mirror of L3) and L3 when L3 is configured, then the remote store when ``remote.url`` is
    set. Fails open like :func:`build_tiers` (an L3 that cannot serve is left out); the remote
    tier's configuration fails closed (:class:`~skippy_llama.errors.ConfigError`)."""
    tiers: list[PointTier] = []
    disk: DiskTier | None = None
    if settings.l3.mode != "off":
        disk = DiskTier(settings.l3)
        if disk.serving:
            if settings.l2.budget:
                tiers.append(RamPoints(settings.l2.budget))
            tiers.append(disk)
        else:
            log.warning(
                "skippy-llama: L3 is %s (%s); restore points stay in memory",
                disk.state,
                disk.reason,
            )
            disk.close()
            disk = None
    if settings.remote.enabled:
        from .remote.points import JobLane, Lane, RemotePoints  # the `remote` extra (redis)
        from .remote.store import RemoteStore

        # pushes leave the request path on L3's writer, as the paged cache's do; without L3
        # on a writer of the same kind of their own
        lane: Lane = disk if disk is not None else JobLane()
        tiers.append(RemotePoints(RemoteStore(settings.remote), lane))
    return tiers


def _remote(context: TierContext, disk: DiskTier | None) -> Tier | None:
    """The shared remote tier when ``remote.url`` is set and the layout is pageable.

    Its configuration fails closed (a missing or unreadable secret raises
    :class:`~skippy_llama.errors.ConfigError` naming the setting); its server fails open.
    Pages are pushed by L3's writer after L3 stored them, so without L3 the tier only reads.
    """
    settings = context.settings.remote
    if not settings.enabled or not context.pageable:
        return None
    from ..codecs.cachegen import CacheGenParams
    from .remote.store import RemoteStore  # the optional `remote` extra (redis)
    from .remote.tier import RemoteTier

    codec = context.identity.codec
    # a lossy identity (l3.codec or remote.codec qualified CacheGen): its pages may travel coded
    lossy = CacheGenParams.from_identity(dict(codec)) if codec else None
    store = RemoteStore(settings, identity=context.identity.root, lossy=lossy)
    load = None
    if disk is not None:

        def load(key: bytes) -> bytes | None:
            pages = disk.read([key])
            return bytes(pages[0]) if pages else None

    tier = RemoteTier(store, context.identity.root, load, context.settings.page_tokens)
    if disk is not None:
        disk.add_write_listener(tier.push)
    else:
        log.warning("skippy-llama: the remote tier reads only: pages are pushed by L3's writer")
    return tier


def _resident(context: TierContext) -> ResidentIndex | None:
    if not context.resident_slots or context.l1_budget_tokens <= 0:
        return None
    return ResidentIndex(
        context.resident_slots,
        context.l1_budget_tokens,
        context.settings.page_tokens,
        window=context.window,
    )


def _disk(context: TierContext) -> DiskTier | None:
    """L3 when configured and the layout is pageable; fail open to L1 only."""
    settings = context.settings
    if settings.l3.mode == "off":
        return None
    if not context.pageable:
        log.warning(
            "skippy-llama: %s: no L2/L3 pages (L1 only; restore points, where the model gets "
            "them, still go to L3 and the remote tier)",
            context.unpageable_reason,
        )
        return None
    l3 = settings.l3
    if l3.compression == "auto":
        # pages are stored as they are (issue 45): a GPU prefill outruns single-page
        # decompression, and on the CPU zstd took 128 ms of the writer's CPU per 500 tokens
        # (SmolLM2; the decode's threads waited for that core) and ~100 ms of a 3,900-token
        # restore, to store 0.86 of the bytes (benchmarks/results/record-path-s45.json)
        l3 = l3.model_copy(update={"compression": "none"})
    identity = context.identity
    # the costs this model measured on this backend in earlier processes, kept in the store
    disk = DiskTier(
        l3,
        admission=AdmissionPolicy(context.costs, tier=DiskTier.name),
        cost_key=(identity.model.id, identity.backend),
    )
    if not disk.serving:
        log.warning("skippy-llama: L3 is %s (%s); continuing without it", disk.state, disk.reason)
    return disk
