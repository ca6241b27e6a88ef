"""Speculation: the one object the engine talks to about drafting, whatever the configuration.

`build_speculation(spec, target)` assembles what a `SpecConfig` asks for: the drafters (one by
name, or every registered `auto` drafter for "auto"), the selector (by name from the selector
registry) and, for a learned drafter trained online, its trainer, which this object owns (it
starts, stops and exports through here). Speculation off is the same object with no drafters and
a selector that always answers OFF, so the engine loop has no `if speculating` branches.

Hooks fan out: bookkeeping reaches every drafter, a proposal goes to the drafter the chosen arm
names, and the learned drafter (at most one: it needs the target's hidden states and a KV layer of
its own) also receives features and the call's sampling state.

Whether a step speculates is decided in one place, `Decision` (decide.py): the forced arm, drafter health,
max_spec_batch, the selector's pick, the loss guard and the gates, with the stage that settled each step counted
as strategy/reason/<stage>. What steps cost and saved is the selector's ledger (ledger.py), which the rollout
metrics (plain step time, drafting cost, acceptance per drafter, seconds saved) are read from.

The selector hears what says whether the learned drafter can pay before it plays (`_feed_gate`,
selectors/gate.py): its trainer's acceptance estimate of each published version, or, for weights that
arrived from elsewhere (warm-start cache, a checkpoint's drafter), that they are trusted.
"""
from __future__ import annotations

import contextlib
import weakref

import torch

from rlspec.rollout.speculation.calibration_cache import calibration_key, load_table, save_table
from rlspec.rollout.speculation.checkpoint import mismatch
from rlspec.rollout.speculation.buckets import reachable_buckets
from rlspec.rollout.speculation.decide import Decision
from rlspec.rollout.speculation.drafters.base import Draft, Drafter, DraftTensors, LearnedDrafter, make_drafter
from rlspec.rollout.registry import DRAFTERS, SELECTORS
from rlspec.rollout.metrics import ledger_metrics
from rlspec.rollout.speculation.selectors.always import AlwaysSelector
from rlspec.rollout.speculation.selectors.base import OFF, Arm, Selector, arm_key, arm_of
from rlspec.rollout.types import SpecConfig


# Share of a learned drafter's acceptance evidence kept when new weights arrive. Versions come from
# the online trainer (a few optimizer steps each) or a warm start before any speculation was
# measured; the selector's change detector catches a version whose acceptance moved far. Dropping
# all evidence at every version (the old rule) reset the drafter to the selector's a = 0.5 prior at
# every RL step of a GRPO run (docs/selectors.md).
UPDATE_KEEP = 0.5


class Speculation:
    def __init__(self, drafters: dict[str, Drafter], selector: Selector, trainer=None,
                 max_spec_batch: int | None = None):
        self.by_name = drafters
        self.selector = selector
        learned = [d for d in drafters.values() if isinstance(d, LearnedDrafter)]
        if len(learned) > 1:
            raise ValueError(f"at most one learned drafter per engine, got {[d.name for d in learned]}")
        self.learned: LearnedDrafter | None = learned[0] if learned else None
        self.trainer = None
        if trainer is not None:
            self.attach_trainer(trainer)
        self._seen_version = self.version()
        self._early: list = []  # the learned drafter's catch-up spans whose device seconds are not known yet
        self._gate_version = self.version()  # the drafter version the selector's gate last heard of
        self._admitted = None  # the trainer's (version, estimate) last handed to the selector
        self.decision = Decision(speculating=bool(drafters), max_spec_batch=max_spec_batch)

    def attach_trainer(self, trainer):
        """Make `trainer` (a DrafterTrainer of the learned drafter, or a ProcessTrainer running one in
        a process of its own) the one that trains it: it receives
        finished samples, publishes weights, is told when compute is idle, stopped by close()."""
        if self.learned is None:
            raise ValueError("no learned drafter to train; use drafter='eagle3' or 'auto'")
        if self.trainer is not None and self.trainer is not trainer:
            self.trainer.stop()
        self.trainer = trainer
        self.learned.attach(trainer)
        # a training thread still running at interpreter exit aborts the process (torch's C++ side
        # terminates), and a training process must not outlive us; stop it at exit, or when this
        # object is collected, whichever comes first
        self._stop_at_exit = weakref.finalize(self, trainer.stop)
        return trainer

    def detach_trainer(self) -> None:
        """Stop training the learned drafter and keep the trainer's newest weights in it. With no
        trainer the drafter no longer stages training data (target top-k at every verified token,
        features of every finished sample): work nobody would read."""
        if self.trainer is None:
            return
        self.learned.swap_latest()
        self._feed_gate()  # the trainer's last estimate (a warm start's) outlives the trainer
        self.trainer.stop()
        self._stop_at_exit.detach()
        self.learned.attach(None)
        self.trainer = None

    @classmethod
    def off(cls) -> "Speculation":
        return cls({}, AlwaysSelector(OFF))

    # ---- what the set holds ------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return list(self.by_name)

    @property
    def learned_names(self) -> tuple[str, ...]:
        return (self.learned.name,) if self.learned is not None else ()

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return tuple(self.learned.aux_layers) if self.learned is not None else ()

    @property
    def extra_kv_layers(self) -> int:
        return self.learned.extra_kv_layers if self.learned is not None else 0

    @property
    def side_buffers(self) -> dict:
        """Per-position buffers the learned drafter keeps in the KV pool's blocks (kv_cache.SideSpec)."""
        return self.learned.side_buffers() if self.learned is not None else {}

    @property
    def max_nodes(self) -> int:
        forced = self.decision.forced
        return max(self.selector.max_nodes, forced.nodes if forced is not None else 0)

    def version(self) -> int:
        return self.learned.version if self.learned is not None else 0

    # ---- the loop's hooks ----------------------------------------------------------------------
    def start(self, seqs, cache, params, generator, history=None, draws=None) -> None:
        """history: the call's TokenHistory when a repetition penalty is on (rollout/runtime/history.py); draws: its
        KeyedDraws when it has per-sample keys (the learned drafter's sampled drafts draw from them). Every
        drafter with a `start` hears of the call (a learned one always; a model-free one that drafts on the device
        takes the cache's device and funnel from it)."""
        for d in self.by_name.values():
            if d is self.learned:
                d.start(seqs, cache, params, generator, history, draws)
            elif getattr(d, "start", None) is not None:
                d.start(seqs, cache, params, generator, history)
        if self.learned is not None:
            self._feed_gate()
        if hasattr(self.selector, "begin_call"):
            self.selector.begin_call()

    def begin(self, groups) -> None:
        for d in self.by_name.values():
            d.begin(groups)

    def choose(self, batch: int) -> Arm:
        """The arm of the next decode step of `batch` live rows (decide.py says why)."""
        return self.decision.decide(self.selector, batch)

    def force(self, arm: Arm | None) -> None:
        """Use `arm` on every step from now on, whatever the selector would choose (OFF: decode plainly
        while a learned drafter still captures features, e.g. to collect training data); None hands
        the choice back. The selector keeps observing every step."""
        self.decision.forced = arm

    def set_healthy(self, healthy: bool) -> None:
        """Drafter health's verdict (drafter_health.py): False decodes plainly until it is True again."""
        self.decision.healthy = healthy

    @contextlib.contextmanager
    def forced(self, arm: Arm):
        """force(arm) for the duration of a `with` block."""
        before = self.decision.forced
        self.force(arm)
        try:
            yield
        finally:
            self.force(before)

    def propose(self, arm: Arm, seqs, caps: list[int]) -> list[Draft]:
        drafts = self.draft(arm, seqs, caps)
        return drafts.to_drafts() if isinstance(drafts, DraftTensors) else drafts

    def draft(self, arm: Arm, seqs, caps: list[int]) -> list[Draft] | DraftTensors:
        """propose()'s drafts, left on the device by a drafter that draws them there (`propose_tensors`)."""
        if not arm.speculative:
            return [Draft() for _ in seqs]
        drafter = self.by_name[arm.drafter]
        if drafter is self.learned:
            drafter.set_stop_rule(arm.stop)
        on_device = getattr(drafter, "propose_tensors", None)
        return drafter.propose(seqs, caps, arm.width) if on_device is None else on_device(seqs, caps, arm.width)

    def draft_ahead(self, arm: Arm, seqs, ahead) -> DraftTensors | None:
        """The arm's chains for a step after one the host has not read (`Ahead`, rollout/chains_ahead.py), on the
        device (None: its drafter cannot this step); the arm's drafter has `propose_ahead`."""
        drafter = self.by_name[arm.drafter]
        if drafter is self.learned:
            drafter.set_stop_rule(arm.stop)
        return drafter.propose_ahead(seqs, arm.nodes, ahead)

    def observe_prefill(self, groups, hiddens: dict) -> None:
        if self.learned is not None and hiddens:
            self.learned.observe_prefill(groups, self._features(hiddens))

    def observe_resume(self, seqs, hiddens: dict) -> None:
        """Preempted sequences were prefilled again: hiddens of positions 0..cache_len-1 of each."""
        if self.learned is not None and hiddens:
            self.learned.observe_resume(seqs, self._features(hiddens))

    def observe_verify(self, seqs, hiddens: dict, path: torch.Tensor | None, accepted: torch.Tensor | None,
                       ahead: int = 0, tokens: torch.Tensor | None = None, start: torch.Tensor | None = None,
                       top: int = 0, logits: torch.Tensor | None = None) -> None:
        """A verify was launched: the learned drafter stages its features (accepted: the counts on the device, None
        for a plain step; tokens: the step's emitted tokens) before the host reads the step; `observe_commit` once
        it has. A chain step looked ahead gives its rows' positions on the device (start, with top a host bound of
        their largest) and its logits, whose training law is staged now (LearnedDrafter.observe_verify)."""
        if self.learned is not None and hiddens:
            self.learned.observe_verify(seqs, self._features(hiddens), path, accepted, ahead, tokens, start, top,
                                        logits)

    def observe_commit(self, seqs, accepted: list[int], logits: torch.Tensor) -> None:
        """The host read the step `observe_verify` saw: accepted drafts per row."""
        if self.learned is not None:
            self.learned.observe_commit(seqs, accepted, logits)

    def observe_step(self, arm: Arm, batch: int, seconds: float | None, draft_seconds: float | None,
                     drafted: list[int], accepted: list[int]) -> None:
        """Feed the selector; new drafter weights make the acceptance it measured partly stale. A learned
        drafter's catch-up over steps it sat out (its backlog) is kept out of the drafting seconds: drafting on
        every step never pays it, and counted in, a probe after a long gap made the drafter's levels look several
        times dearer than they are, so the selector dropped it again at once (docs/selectors.md). seconds and
        draft_seconds None: the step captured its graph first, its time no measure of a cost; its acceptance
        counts."""
        if self.version() != self._seen_version:
            self._seen_version = self.version()
            self.selector.reset_acceptance(self.learned.name, keep=UPDATE_KEEP)
            self._feed_gate()
        if self.learned is not None and arm.drafter == self.learned.name and seconds is not None:
            draft_seconds = max(draft_seconds - self.learned.backlog_seconds, 0.0)
            # the next proposal's catch-up, launched before this step's read: drafting, not verify. It was queued
            # after the step's transfer, so its device seconds are known only once it ran: those not yet known are
            # counted at a later step of the drafter (the sum is the same; the host does not wait for them)
            if self.learned.early_span is not None:
                self._early.append(self.learned.early_span)
                self.learned.early_span = None
            moved = 0.0
            while self._early and self._early[0].done():
                moved += self._early.pop(0).seconds()
            seconds, draft_seconds = max(seconds - moved, 0.0), draft_seconds + moved
        self.selector.observe(arm, batch, seconds, draft_seconds, drafted, accepted)

    def evict(self, seq) -> None:
        """seq was preempted: its KV blocks are gone, the learned drafter's layer with them."""
        if self.learned is not None:
            self.learned.evict(seq)

    def finish(self, seq) -> None:
        """Model-free drafters index finished samples; a learned one banks them for training."""
        for d in self.by_name.values():
            d.finish(seq)

    def settle(self) -> None:
        """A step's device work is launched: drafters do what they deferred from finish() (the suffix drafter's
        global window), while the device runs it rather than between two steps."""
        for d in self.by_name.values():
            settle = getattr(d, "settle", None)  # optional: a drafter defers nothing without it
            if settle is not None:
                settle()

    def abandon(self, seqs) -> None:
        """A partial round stopped these unfinished samples (rollout/partial.py): drafters drop what they hold
        for them without indexing or banking them; a later call brings them back as new sequences."""
        for d in self.by_name.values():
            drop = getattr(d, "abandon", None)  # optional: a drafter keeping nothing per sample needs none
            for seq in seqs if drop is not None else ():
                drop(seq)

    def set_policy_version(self, version: int) -> None:
        if self.learned is not None:
            self.learned.set_policy_version(version)

    def set_idle(self, idle: bool) -> None:
        """Tell the online trainer whether compute is spare (rollout tail, or between rollouts)."""
        if self.trainer is not None:
            self.trainer.set_idle(idle)

    def _feed_gate(self) -> None:
        """Tell the selector's gate (selectors/gate.py) what judges the learned drafter's weights: the
        trainer's estimated acceptance of its newest published version (None from the trainer: weights
        it was given, not trained, e.g. the warm-start cache's), or, with no trainer, that weights
        which changed came from elsewhere and are trusted. Each piece of evidence is handed over once."""
        admit = getattr(self.selector, "admit", None)
        if admit is None or self.learned is None:
            return
        estimate = getattr(self.trainer, "acceptance_estimate", None)
        judged = estimate() if estimate is not None else None  # (version, rate or None) or None
        if judged is not None and judged != self._admitted:
            self._admitted = judged
            self._gate_version = max(self._gate_version, int(judged[0]))
            admit(self.learned.name, judged[1])
        elif self.trainer is None and self.version() != self._gate_version:
            self._gate_version = self.version()
            admit(self.learned.name, None)

    def _features(self, hiddens: dict) -> torch.Tensor:
        """EAGLE-3 features: the chosen layers' hidden states side by side [.., 3H]."""
        return torch.cat([hiddens[i] for i in self.aux_layers], dim=-1)

    # ---- costs, metrics, lifetime ------------------------------------------------------------
    def calibrate(self, runner, rows: int, length: int) -> None:
        """Seed the cost model for every batch bucket this call can reach that has no plain-step cost yet:
        dummy forwards at the verify sizes' anchors, or the table an earlier engine measured on this machine
        for this model and runner mode (calibration_cache.py), to which newly timed buckets are added. Per
        call, not once: a bucket first reached by a later, larger call had only its verify steps observed,
        and its plain cost, read off the smallest of them, came out at twice a plain step (every draft then
        looked twice as good: `auto` speculated on every step of 3-4 rows, at 0.6-0.8x of plain decoding)."""
        sizes = sorted(set(self.selector.verify_sizes()))
        runner.warm(sizes or [1, 1 + self.selector.max_nodes], rows)  # compile before the steps, cached table or not
        if not sizes:  # the selector never reads costs
            return
        costs = self.selector.costs
        missing = [b for b in reachable_buckets(rows) if (b, sizes[0]) not in costs.table]
        if not missing:
            return
        ctx = max(min(128, length - max(sizes) - 1), 1)
        key = calibration_key(runner, sizes, ctx)
        cached = load_table(key)
        costs.table.update({k: s for k, s in cached.items() if k[0] in missing})
        todo = [b for b in missing if (b, sizes[0]) not in costs.table]
        if todo:
            skip = tuple(b for b in reachable_buckets(rows) if b not in todo)
            save_table(key, {**cached, **costs.calibrate(runner, rows, sizes, context=ctx, skip=skip)})

    def metrics(self, stats: dict[str, float], policy_version: int) -> dict[str, float]:
        """The selector's strategy/* metrics, the decision's reason counts and the ledger's rollout figures since
        the last call (plain step time, drafting cost and acceptance per drafter, seconds saved)."""
        out = dict(self.selector.metrics())
        out.update(self.decision.metrics())
        ledger = getattr(self.selector, "ledger", None)
        if ledger is not None:
            out.update(ledger_metrics(ledger.take_window()))
        if self.learned is not None:
            out["drafter/accept_len"] = out.get(f"rollout/accept_len/{self.learned.name}", 1.0)
        if self.trainer is not None:
            out.update(self.trainer.metrics(policy_version))
        return out

    def export_drafter(self, path: str, target_hf_config, metadata: dict | None = None) -> str:
        """Write the learned drafter (the trainer's latest weights when training online) in the
        EAGLE-3 format vLLM and SGLang load."""
        if self.learned is None:
            raise ValueError("this engine has no learned drafter to export; use drafter='eagle3' or 'auto'")
        from rlspec.rollout.speculation.drafters.eagle3_io import save_learned

        return save_learned(self.learned, self.trainer, target_hf_config, path, metadata)

    # ---- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything speculation carries from one generate() call to the next, as plain Python values
        and CPU tensors (torch.save / torch.load(weights_only=True)): the selector's statistics and
        cost table, each drafter's state (suffix history, EAGLE-3 weights and version), the online
        trainer's (master weights, optimizer, buffer, sampler generator) and the version of the
        drafter weights the selector last saw. Take it between generate() calls (docs/selectors.md#checkpoints)."""
        trainer = self.trainer.state_dict() if self.trainer is not None else None
        return {"format": STATE_FORMAT, "drafters": {n: _state_of(d) for n, d in self.by_name.items()},
                "selector": _state_of(self.selector), "trains": self.trainer is not None, "trainer": trainer,
                "seen_version": self._seen_version,
                "forced": None if self.decision.forced is None else arm_key(self.decision.forced)}

    def load_state_dict(self, state: dict) -> None:
        """Continue from state_dict() of an engine built the same way: after it, generate() gives what
        the saved engine would have given. A state of another configuration (drafters, selector and its
        arms, the learned drafter's shape, online training or not) raises a ValueError that lists every
        difference, before anything is changed."""
        problems = self._misfits(state)
        if problems:
            raise ValueError("the checkpoint's speculation state does not fit this engine:\n  " + "\n  ".join(problems))
        if state["selector"] is not None:
            self.selector.load_state_dict(state["selector"])
        for name, d in self.by_name.items():
            if state["drafters"][name] is not None:
                d.load_state_dict(state["drafters"][name])
        if self.trainer is not None:
            self.trainer.load_state_dict(state["trainer"])
        self._seen_version = int(state["seen_version"])
        # the selector's state holds its gates: evidence already given must not be given again
        self._gate_version = self.version()
        estimate = getattr(self.trainer, "acceptance_estimate", None)
        self._admitted = estimate() if estimate is not None else None
        self.decision.forced = None if state["forced"] is None else arm_of(state["forced"])

    def _misfits(self, state: dict) -> list[str]:
        """What differs between a saved state and this object's configuration, one line each."""
        fix = "build the engine with the SpecConfig of the run that saved it"
        if state.get("format") != STATE_FORMAT:
            return [mismatch("state format", state.get("format"), STATE_FORMAT, "not a Speculation.state_dict()")]
        out = []
        if list(state["drafters"]) != self.names:
            out.append(mismatch("drafters", list(state["drafters"]), self.names, fix + ": SpecConfig.drafter"))
        else:
            out += [f"{name}: {m}" for name, d in self.by_name.items() if hasattr(d, "state_misfit")
                    and state["drafters"][name] is not None and (m := d.state_misfit(state["drafters"][name]))]
        out += _selector_misfits(state["selector"], _state_of(self.selector), fix)
        trains, dead = self.trainer is not None, state["trains"] and state["trainer"] is None
        if trains and dead:
            out.append("online drafter training: the checkpoint's trainer had died (or had no state_dict), so its "
                       "state was not saved "
                       "(resume with SpecConfig.online_training=False to keep its drafter without training)")
        elif state["trains"] != trains and not dead:
            out.append(mismatch("online drafter training", state["trains"], trains, fix + ": online_training"))
        return out

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.stop()


def build_speculation(spec: SpecConfig, target, custom: Drafter | None = None) -> Speculation:
    """Drafters, selector and (for a learned drafter trained online) its trainer, as `spec` asks."""
    if not spec.enabled and custom is None:
        return Speculation.off()
    if custom is not None:
        drafters = {custom.name: custom}
    else:
        names = [n for n in DRAFTERS.names() if DRAFTERS.meta(n).get("auto")] if spec.drafter == "auto" \
            else [spec.drafter]
        names.sort(key=lambda n: _AUTO_ORDER.get(n, len(_AUTO_ORDER)))  # the first drafter is the one "fixed" and "always" use
        drafters = {n: make_drafter(n, target=target, spec=spec) for n in names}
    trainer = None
    learned = next((d for d in drafters.values() if isinstance(d, LearnedDrafter)), None)
    if learned is not None and trains_online(spec, learned.target):
        from rlspec.rollout.speculation.training.trainer_process import make_trainer

        trainer = make_trainer(learned, spec)  # a thread or a process of its own, as spec.online_trainer says
    # "auto" means choosing among drafters per batch: the fixed policy has one drafter, so auto is adaptive
    selector_name = "adaptive" if spec.drafter == "auto" and spec.selector == "fixed" else spec.selector
    learned_names = (learned.name,) if learned is not None else ()
    return Speculation(drafters, SELECTORS.build(selector_name, spec, list(drafters), learned_names), trainer,
                       max_spec_batch=spec.max_spec_batch)


def trains_online(spec: SpecConfig, target) -> bool:
    """SpecConfig.online_training resolved: "auto" trains online on an accelerator only. A CPU has no
    idle compute for it: decoding uses every core even in the tail and so does the policy update
    (measured, see SpecConfig's help), so a trainer there slows the rollout it is meant to speed up."""
    if spec.online_training != "auto":
        return bool(spec.online_training)
    return next(target.parameters()).device.type != "cpu"


STATE_FORMAT = 1  # Speculation.state_dict layout version


def _selector_misfits(saved: dict | None, here: dict | None, fix: str) -> list[str]:
    """Another selector kind, or the same kind with other arms (shown as the arms only one side has)."""
    if here is None or saved is None:
        return [] if here is saved else [mismatch("selector state", saved is not None, here is not None, fix)]
    if saved["kind"] != here["kind"]:
        return [mismatch("selector", saved["kind"], here["kind"], fix + ": SpecConfig.selector / drafter")]
    if list(saved["shape"]) == list(here["shape"]):
        return []
    a, b = list(saved["shape"]), list(here["shape"])
    if a and isinstance(a[0], (list, tuple)):  # a list of arms: name what differs, not all of them
        a, b = [x for x in a if x not in b], [x for x in b if x not in a]
    return [mismatch(f"{here['kind']} selector arms (only in each)", a, b,
                     fix + ": drafter, num_draft_tokens, tree_width")]


def _state_of(obj):
    """obj.state_dict(), or None for a plug-in (drafter, selector) without one: it carries nothing."""
    return obj.state_dict() if hasattr(obj, "state_dict") else None


# "auto" lists the cheap model-free drafters first; plug-ins marked auto come after them
_AUTO_ORDER = {"suffix": 0, "ngram": 1, "eagle3": 2}

