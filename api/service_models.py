"""Models by Hub id in the API: the submit checks of a Hub model (or Hub adapter), and `gpujobs models
list/pull/rm`. No torch: config.json and the tokenizer are read with json and `tokenizers` (core/preflight.py).

At submit, where this process reaches the Hub (HF_ENDPOINT, not HF_HUB_OFFLINE), the revision is resolved to its
commit and stored as the spec's `revision` (the words the user gave stay in `metrics.model.revision`), so every
shard on every host loads that commit and a retry or a copy of the spec loads it again; the file list says which
files a load needs (a repo with pickled weights only is refused); config.json and the tokenizer are fetched into
this host's cache to check the architecture, the context and each row's token count. Where it cannot reach the
Hub, the live workers' caches (table cached_models) and its own answer what they can; when every live worker is
offline, a model that none of their caches holds is refused here rather than failing on a GPU host later.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core import adapters, hub, hub_download, model_cache, registry
from core.db import session_scope
from core.errors import Conflict, HubUnreachable, InvalidInput, NoAccess, Unschedulable, naming
from core.settings import get_settings
from core.spec import Spec

log = logging.getLogger(__name__)


@dataclass
class HubCheck:
    """What the submit of a spec learnt about its Hub model and adapter."""

    spec: Spec
    local_dir: Path | None = None  # this host's snapshot folder with config.json and the tokenizer (token checks)
    metrics: dict[str, Any] = field(default_factory=dict)  # `model` and `adapter` records for the job's metrics
    notes: list[str] = field(default_factory=list)  # for the job's events


@dataclass
class Fleet:
    """The live workers as far as models go: where their caches are, whether they reach the Hub, their tokens."""

    workers: list
    places: set[tuple[str, str]]
    online: list
    with_token: list
    model_types: set[str]

    @classmethod
    def now(cls) -> Fleet:
        with session_scope() as session:
            workers = registry.live(session, get_settings().worker_timeout)
        hubs = [((w.capabilities or {}).get("hub") or {}, w) for w in workers]
        types = set().union(*[set((w.capabilities or {}).get("model_types") or ()) for w in workers])
        return cls(
            workers,
            model_cache.live_places(workers),
            [w for h, w in hubs if h and not h.get("offline")],
            [w for h, w in hubs if h.get("token") and not h.get("offline")],
            types,
        )

    @property
    def all_offline(self) -> bool:
        return bool(self.workers) and not self.online


def check(spec: Spec) -> HubCheck:
    """The submit checks of a spec's Hub model and Hub adapter (a spec with neither comes back unchanged)."""
    result = HubCheck(spec)
    model_is_hub = hub.is_hub_id(spec.model)
    adapter_is_hub = bool(getattr(spec, "adapter", None)) and hub.is_hub_id(spec.adapter)
    if not (model_is_hub or adapter_is_hub):
        return result
    fleet = Fleet.now()
    if model_is_hub:
        with naming("model"):
            _check_model(result, fleet)
    if adapter_is_hub:
        with naming("adapter"):
            _check_adapter(result, fleet)
    return result


def _check_model(result: HubCheck, fleet: Fleet) -> None:
    spec = result.spec
    repo, revision = spec.model, spec.revision or "main"
    snap = _resolve(repo, revision, "model", fleet, result.notes)
    cached = _cached(repo, revision, fleet, snap.commit if snap else None)
    commit = snap.commit if snap else _agreed(cached)
    record: dict[str, Any] = {"repo": repo, "revision": revision, "commit": commit}
    if snap is not None:
        record.update(files=len(snap.files), bytes=snap.bytes, resolved_by="api")
        result.local_dir = hub_download.submit_files(snap)
    elif commit is not None:
        record["resolved_by"] = "worker cache"
        result.local_dir = _own_snapshot(repo, commit)
    if fleet.all_offline and not cached:
        raise Unschedulable(_offline_refusal(repo, revision, snap, fleet))
    if result.local_dir is not None:
        _check_config(repo, result.local_dir, fleet, spec)
    elif snap is None:
        result.notes.append(
            f"{hub.describe(repo, revision)}: the API read no config.json (no Hub access and not in "
            "its cache): architecture, context and token checks left to the worker"
        )
    if commit:
        result.spec = spec.model_copy(update={"revision": commit})
    result.metrics["model"] = record


def _check_adapter(result: HubCheck, fleet: Fleet) -> None:
    spec = result.spec
    repo, revision = spec.adapter, spec.adapter_revision or "main"
    snap = _resolve(repo, revision, "adapter", fleet, result.notes)
    cached = _cached(repo, revision, fleet, snap.commit if snap else None)
    if fleet.all_offline and not cached:
        raise Unschedulable(_offline_refusal(repo, revision, snap, fleet))
    commit = snap.commit if snap else _agreed(cached)
    folder = hub_download.submit_files(snap) if snap else (_own_snapshot(repo, commit) if commit else None)
    config = hub.read_json(folder, hub.ADAPTER_CONFIG) if folder else None
    if config is not None:
        result.notes.append(_adapter_note(repo, config, spec.model))
    if commit:
        result.spec = result.spec.model_copy(update={"adapter_revision": commit})
    result.metrics["adapter"] = {"repo": repo, "revision": revision, "commit": commit}


def _resolve(repo: str, revision: str, kind: str, fleet: Fleet, notes: list[str]) -> hub.Snapshot | None:
    """The snapshot on the Hub, or None where this process cannot ask it (offline, unreachable, or no token here
    while a worker has one). Refusals the Hub makes (no such repo or revision, pickled weights only) raise."""
    if get_settings().hub_offline:
        return None
    try:
        return hub_download.plan(repo, revision, kind=kind, retries=0)  # fail fast: the workers ask again
    except HubUnreachable as exc:
        if fleet.all_offline:
            return None
        notes.append(f"the API cannot reach the Hub ({exc}); the workers resolve {hub.describe(repo, revision)}")
        return None
    except NoAccess as exc:
        if not fleet.with_token:
            raise
        notes.append(
            f"the API has no Hugging Face token for {repo} ({exc}); the workers' token is used and the worker checks it"
        )
        return None


def _cached(repo: str, revision: str, fleet: Fleet, commit: str | None) -> list:
    """Live workers' cache rows of `repo` that hold the commit (when known) or the revision."""
    with session_scope() as session:
        rows = model_cache.ready_in(session, repo, fleet.places)
        return [
            (r.host, r.commit) for r in rows if (r.commit == commit if commit else model_cache.matches(r, revision))
        ]


def _agreed(cached: list) -> str | None:
    commits = {c for _, c in cached}
    return commits.pop() if len(commits) == 1 else None


def _own_snapshot(repo: str, commit: str) -> Path | None:
    folder = hub.repo_dir(repo) / "snapshots" / commit
    return folder if (folder / hub.CONFIG).is_file() or (folder / hub.ADAPTER_CONFIG).is_file() else None


def _offline_refusal(repo: str, revision: str, snap: hub.Snapshot | None, fleet: Fleet) -> str:
    names = ", ".join(sorted(w.name for w in fleet.workers))
    what = f"{hub.describe(repo, revision)}" + (f" (commit {snap.commit})" if snap else "")
    return (
        f"{what} is not in the Hugging Face cache of any live worker, and every live worker is offline "
        f"(HF_HUB_OFFLINE=1: {names}): put it in their cache from a host with network access (`gpujobs models "
        f"pull {repo}` there, or `hf download {repo}`, into the cache the workers use), start workers that reach "
        "the Hub, or name a model they have (`gpujobs models list`)"
    )


def _check_config(repo: str, folder: Path, fleet: Fleet, spec: Spec) -> None:
    """The architecture: a causal LM that the live workers' transformers loads (their registrations list them)."""
    config = hub.read_json(folder, hub.CONFIG)
    if config is None:
        raise InvalidInput(f"{repo}: config.json is not a JSON object: the repo is not a transformers model")
    model_type = config.get("model_type")
    if not fleet.model_types or spec.trust_remote_code:
        return
    if model_type not in fleet.model_types:
        archs = ", ".join(config.get("architectures") or []) or "no architectures listed"
        versions = sorted(
            {((w.capabilities or {}).get("versions") or {}).get("transformers") or "?" for w in fleet.workers}
        )
        raise InvalidInput(
            f"{repo}: model_type {model_type!r} ({archs}) is not a causal language model that "
            f"transformers {', '.join(versions)} on the live workers loads (AutoModelForCausalLM): "
            "gpujobs runs causal LMs; pick another model, or upgrade transformers on the workers"
        )


def _adapter_note(repo: str, config: dict[str, Any], model: str) -> str:
    """The Hub adapter's config, checked as an uploaded adapter's is (core/adapters.py): LoRA, base by name."""
    if str(config.get("peft_type", "")).upper() not in adapters.LORA_TYPES:
        raise InvalidInput(
            f"adapter {repo}: peft_type {config.get('peft_type')!r} is not a LoRA adapter; only LoRA "
            "adapters can be loaded"
        )
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(adapters.BASE_CHANGING_INITS):
        raise InvalidInput(
            f"adapter {repo}: init_lora_weights {init!r} changes the base model's weights, so the "
            "adapter does not apply to a plain base"
        )
    named = config.get("base_model_name_or_path")
    if not named:
        return f"adapter {repo} names no base model: not checked at submit; it must fit {model}"
    if not isinstance(named, str) or adapters.same_base(named, model) is None:
        raise InvalidInput(f"adapter {repo} was trained on {named!r}, not on {model!r}: submit with --model {named}")
    return f"adapter {repo}: LoRA r={config.get('r')} on base {named!r} (matched by {adapters.same_base(named, model)})"


# --- gpujobs models list / pull / rm --------------------------------------------------------------------------


def list_models(*, repo: str | None = None) -> list[dict[str, Any]]:
    """Every place's snapshots (and requests in flight), with sizes, last use and any download's progress."""
    with session_scope() as session:
        return [model_cache.view(r) for r in model_cache.listing(session, repo)]


def request(action: str, *, repo: str, revision: str | None, workers: str, by: str) -> list[dict[str, Any]]:
    """Ask the places of the named live workers (`all`, or names separated by commas) to pull or remove `repo`.

    A pull's revision is resolved here when this process reaches the Hub (an unknown repo or revision is refused at
    once); otherwise the worker resolves it. A removal names every snapshot of the repo in those places, or only
    the one `revision` names; a place downloading it is refused (wait for the download, then remove)."""
    if not hub.HUB_ID.match(repo or ""):
        raise InvalidInput(f"{repo!r} is not a Hub id: give org/name, e.g. Qwen/Qwen3-0.6B")
    places = _places(workers)
    if action == "pull":
        commit = ""
        if not get_settings().hub_offline:
            try:
                commit = hub.listing(repo, revision, retries=0)[0]
            except HubUnreachable:
                commit = ""
        with session_scope() as session:
            rows = model_cache.request(
                session, places=places, repo=repo, action="pull", by=by, revision=revision or "main", commit=commit
            )
            return [model_cache.view(r) for r in rows]
    with session_scope() as session:
        rows = [
            r
            for r in model_cache.listing(session, repo)
            if (r.host, r.cache_dir) in places and (revision is None or model_cache.matches(r, revision))
        ]
        busy = [f"{r.host} ({r.state})" for r in rows if r.state in ("downloading", "removing")]
        if busy:
            raise Conflict(
                f"{repo} is being downloaded or removed on {', '.join(busy)}: wait for it to end "
                "(`gpujobs models list`), then remove it"
            )
        if not rows:
            raise InvalidInput(
                f"no live worker's cache holds {hub.describe(repo, revision)} (see `gpujobs models list`)"
            )
        for row in rows:
            row.state, row.requested_by, row.error, row.worker = "remove_requested", by, None, None
        return [model_cache.view(r) for r in rows]


def _places(workers: str) -> set[tuple[str, str]]:
    with session_scope() as session:
        live = registry.live(session, get_settings().worker_timeout)
    if not live:
        raise Unschedulable("no live worker: start workers (`gpujobs up`, `gpujobs worker`) and ask again")
    names = None if workers.strip() == "all" else {n.strip() for n in workers.split(",") if n.strip()}
    unknown = sorted((names or set()) - {w.name for w in live})
    if unknown:
        raise InvalidInput(f"no live worker named {', '.join(unknown)}: see `gpujobs workers`, or pass --workers all")
    chosen = [w for w in live if names is None or w.name in names]
    places = model_cache.live_places(chosen)
    if not places:
        raise Unschedulable(
            "the chosen workers registered no Hugging Face cache (they run an older gpujobs): restart them"
        )
    return places
