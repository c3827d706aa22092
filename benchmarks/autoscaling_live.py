"""Replicas against the SLO, live on this machine: knobs only, knobs + replicas, and an HPA on queue depth,
each driving real pods of the bundled model through a real API server (issue 29).

What runs: etcd, kube-apiserver and kube-controller-manager on loopback (tests/kube_support.py), the
manifests' RBAC, `iterserve operator` as a subprocess with only those rights, the kubelet stand-in
(tests/kubelet_standin.py: each pod an `iterserve serve --threads 1` on its own 127.0.0.N, its preStop
hook run before the SIGTERM) and a Service stand-in (tests/service_standin.py: each request round-robin
to the pods that are Ready and not terminating, as a plain Service sends it). Every run is a fresh
LLMService (1 replica, tuning `auto`) under the same stepped load (low, a peak that
one pod cannot carry at any knob setting, low: benchmarks/tuning_load.py's mix of chats and documents).

- knobs: the tuner alone, spec.replicas 1;
- replicas: the tuner and spec.autoscaling (1 to `--max-replicas`), the product's loop;
- router: the same, with every request through `iterserve router` (spec.router's default policy,
  least-load) run by this script as the router Deployment's pod runs it (`--dns-name` of the pods'
  headless Service), its DNS answered by a stand-in (tests/dns_standin.py: /etc/hosts lines kept to the
  Ready, non-terminating pods; root needed): the router's Deployment is not started here (the kubelet
  stand-in runs server pods only), so its pod is not in the replica-seconds;
- hpa-T: the tuner, and an HPA on the pods' mean `vllm:num_requests_waiting` at threshold T played by
  this script every 15 s through the LLMService's scale subresource, as the shipped example
  (manifests/samples/external-autoscalers/) would: its formula and tolerance (benchmarks/autoscaling.py's
  `Hpa`), its scale-down window set to spec.autoscaling's here, so that both may give a pod back as soon.

Every run starts from the same knobs (`--start-knobs`); the tuner moves them within the same bounds.
Calibration, first, on one pod: a long prompt's TTFT and the inter-token gap alone, and the requests per
second one pod finishes under overload (at the tuner's starting knobs), and the same for two pods; the
SLOs are factors of the first two, the load's rates factors of the one-pod capacity. Per run: 20-second
windows, within SLO when the p99 TTFT of the requests that arrived in them and the p99 of the gaps that
ended in them meet the SLOs (benchmarks/tuning_load.py); "after convergence" leaves out the windows that
overlap the `--settle-s` after each step of the load; replica-seconds are the pods that existed (starting,
serving or draining) integrated over the load. `--json` keeps each run's windows, pods, Events and the
Tuned and Autoscaling conditions as the operator wrote them and the tuner's `lastDecision` (its action
and reason, kind `Decision`), each change with its second (`conditions`: why the replicas and knobs were
what they were, and what the tuner held, tick by tick). Runs alternate their order from round to
round. A benchmark:
it prints and asserts nothing. `tests/test_autoscaling_live.py` runs a small one on the tiny model.

    python benchmarks/autoscaling_live.py                         # 1 round: knobs, replicas, router, hpa 1 and 4
    python benchmarks/autoscaling_live.py --start-knobs 4,128     # knobs far from tuned, as the simulator starts
    python benchmarks/autoscaling_live.py --rounds 2 --controllers replicas,hpa-1
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `benchmarks.*` and `tests.*`, run as a file

import kubernetes  # noqa: E402
import yaml  # noqa: E402

from benchmarks.live_players import NAMESPACE, HpaPlayer, Router, StatusLog  # noqa: E402
from benchmarks.tuning_load import Phase, StepLoad, send_load, share_within, window_figures  # noqa: E402
from iterserve.bench.report import itls  # noqa: E402
from iterserve.operator.builders.labels import IN_ROTATION, ROTATION_LABEL  # noqa: E402
from iterserve.operator.constants import GROUP, PLURAL, VERSION  # noqa: E402
from tests.kube_support import start_cluster  # noqa: E402
from tests.kubelet_standin import LocalKubelet  # noqa: E402
from tests.operator_support import admin_kube, events_for, rendered_manifests, start_operator  # noqa: E402
from tests.service_standin import NoEndpoints, ServiceStandin  # noqa: E402
from tests.waiting import wait_until  # noqa: E402


@dataclass(frozen=True)
class Setup:
    model: str | None  # None: the bundled model
    engine: dict  # with the starting knobs
    bounds: dict
    slo: dict  # ttftP99Ms, itlP99Ms
    load: StepLoad
    window_s: float
    settle_s: float
    max_replicas: int
    scale_down_s: int
    tuning: dict


def parse_args(argv=None) -> argparse.Namespace:
    # no abbreviations: `--out` (benchmarks/autoscaling.py's flag) would be taken for `--output`
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--controllers", default="knobs,replicas,router,hpa-1,hpa-4",
                   help="comma-separated: knobs, replicas, router, hpa-T (T: mean requests waiting per pod)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--model", default=None, help="a model directory (default: the bundled SmolLM2-135M)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--start-knobs", default="16,128", help="max_num_seqs,prefill_chunk_size each run starts from")
    p.add_argument("--max-replicas", type=int, default=2)
    p.add_argument("--rates", default="0.4,1.4,0.4", help="the load's phases, as multiples of one pod's capacity")
    p.add_argument("--phase-s", default="90,180,150")
    p.add_argument("--ttft-factor", type=float, default=8.0, help="TTFT SLO: this x a long prompt's TTFT alone")
    p.add_argument("--itl-factor", type=float, default=16.0,
                   help="ITL SLO: this x the inter-token gap alone (a step that carries a 128-token prefill chunk "
                        "fits, one of 256 does not)")
    p.add_argument("--window-s", type=float, default=20.0)
    p.add_argument("--settle-s", type=float, default=60.0, help="left out after each step of the load")
    p.add_argument("--scale-down-s", type=int, default=60, help="scale-down stabilization, both controllers")
    p.add_argument("--tuning-interval-s", type=int, default=5)
    p.add_argument("--tuning-window-s", type=int, default=20)
    p.add_argument("--calibrate-s", type=float, default=40.0, help="each overload run of the calibration")
    p.add_argument("--overload-rps", type=float, default=8.0,
                   help="the calibration's arrival rate per pod: above what one pod finishes")
    p.add_argument("--long-prompt", default="280,320")
    p.add_argument("--output", default="32,96")
    p.add_argument("--long-output", default="8,16")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def pair(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    return lo, hi


def llmservice_spec(setup: Setup, controller: str) -> dict:
    spec: dict = {"replicas": 1, "drainTimeoutSeconds": 30,
                  "engine": dict(setup.engine),
                  "slo": setup.slo, "tuning": {**setup.tuning, "mode": "auto", "bounds": setup.bounds}}
    if setup.model:
        spec["model"] = {"source": "path", "path": setup.model}
    if controller in ("replicas", "router"):
        spec["autoscaling"] = {"minReplicas": 1, "maxReplicas": setup.max_replicas,
                               "scaleDownStabilizationSeconds": setup.scale_down_s}
    return spec


class Live:
    """The cluster and the processes around the operator, for every run."""

    def __init__(self, args: argparse.Namespace, workdir: Path):
        self.args, self.workdir = args, workdir
        self.cluster = start_cluster(workdir / "kube")
        try:
            self.client = self.cluster.api_client()
            self.custom = kubernetes.client.CustomObjectsApi(self.client)
            docs = [d for d in rendered_manifests() if d["kind"] != "Deployment"]
            self.cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
            self.cluster.kubectl("create", "namespace", NAMESPACE)
            self.operator = start_operator(self.cluster, NAMESPACE, "--standalone", resync_seconds=10)
            model_paths = {args.model: args.model} if args.model else None
            self.kubelet = LocalKubelet(self.cluster, namespace=NAMESPACE, prestop=True, model_paths=model_paths,
                                        log_dir=workdir / "pods").start()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for stop in (lambda: self.kubelet.stop(), lambda: self.operator.stop(), self.cluster.stop):
            try:
                stop()
            except Exception:
                pass

    def create(self, name: str, spec: dict) -> ServiceStandin:
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "LLMService",
                "metadata": {"name": name, "namespace": NAMESPACE}, "spec": spec}
        self.custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, body)
        service = ServiceStandin(self.client, NAMESPACE, f"app.kubernetes.io/instance={name}",
                                 endpoint_labels={ROTATION_LABEL: IN_ROTATION}).start()
        wait_until(lambda: service.endpoints(), timeout=600, what=f"{name}'s first pod Ready", interval=0.5)
        return service

    def delete(self, name: str, service: ServiceStandin) -> None:
        self.custom.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name)
        wait_until(lambda: service.pods() == 0, timeout=300, what=f"{name}'s pods gone", interval=0.5)
        service.stop()

    def events(self, name: str) -> list[dict]:
        return events_for(admin_kube(self.cluster), NAMESPACE, name)


def route_of(service: ServiceStandin):
    last: list[str] = []

    def route() -> str:
        try:
            last[:] = [service.next_url()]
        except NoEndpoints:
            pass  # sent where the last one went: it fails as a request to a gone pod would
        return last[0]
    return route


def overload_capacity(live: Live, setup: Setup, replicas: int, seconds: float, rate: float) -> float:
    """Requests per second `replicas` pods finish under an overload of the load's mix (`rate` a pod; the
    tuner off, max_num_seqs half its upper bound, chunk 256): the completions in the run's second half."""
    name = f"calibrate-{replicas}"
    spec = {**llmservice_spec(setup, "knobs"), "replicas": replicas, "tuning": {"mode": "off"}}
    spec["engine"] = {**setup.engine, "maxNumSeqs": setup.bounds["maxNumSeqs"]["max"] // 2,
                      "prefillChunkSize": 256}
    service = live.create(name, spec)
    wait_until(lambda: len(service.endpoints()) == replicas, timeout=600, what=f"{replicas} pods Ready")
    load = StepLoad((Phase(rate=rate * replicas, duration_s=seconds),), long_prompt=setup.load.long_prompt,
                    output=setup.load.output, long_output=setup.load.long_output, seed=setup.load.seed + 7)
    records = send_load(service.endpoints()[0], load, drain_s=0.0, route=route_of(service))
    done = [r for r in records if r.ok and r.end is not None and seconds / 2 <= r.end <= seconds]
    live.delete(name, service)
    return len(done) / (seconds / 2)


def alone(live: Live, setup: Setup) -> dict:
    """A long prompt's TTFT and the median inter-token gap, one request at a time on one idle pod."""
    name = "calibrate-alone"
    service = live.create(name, {**llmservice_spec(setup, "knobs"), "tuning": {"mode": "off"}})
    load = StepLoad((Phase(rate=0.5, duration_s=30.0),), long_prompt=setup.load.long_prompt,
                    output=setup.load.output, long_output=setup.load.long_output, seed=setup.load.seed + 9)
    records = send_load(service.endpoints()[0], load, drain_s=30.0)
    live.delete(name, service)
    long = [r.first_token - r.start for r in records if r.ok and r.kind == "long" and r.first_token]
    gaps = [g for r in records if r.ok for g in itls(r)]
    return {"ttft_long_ms": 1000 * statistics.median(long), "itl_ms": 1000 * statistics.median(gaps)}


def settled(windows: list[dict], load: StepLoad, settle_s: float, window_s: float) -> list[dict]:
    """The windows after convergence: those that overlap no step's first `settle_s` (a window that holds the
    first seconds of a step, the phases not being whole windows, holds what no controller had time for)."""
    starts = [sum(p.duration_s for p in load.phases[:i]) for i in range(len(load.phases))]
    return [w for w in windows
            if not any(w["start_s"] < s + settle_s and w["start_s"] + window_s > s for s in starts)]


def run_one(live: Live, setup: Setup, controller: str, name: str) -> dict:
    service = live.create(name, llmservice_spec(setup, controller))
    player = router = None
    if controller.startswith("hpa-"):
        player = HpaPlayer(live.custom, name, service, float(controller[4:]), setup.max_replicas,
                           setup.scale_down_s)
    if controller == "router":
        router = Router(name, service)
    conditions = StatusLog(live.custom, name)
    conditions.start()
    clock: dict = {}

    def on_start(t0: float) -> None:
        clock["t0"] = t0
        if player is not None:
            player.start()

    route = route_of(service) if router is None else (lambda: router.url)
    records = send_load(service.endpoints()[0], setup.load, drain_s=60.0, on_start=on_start, route=route)
    conditions.stopped.set()
    if player is not None:
        player.stopped.set()
    router_log = router.stop() if router is not None else ""
    t0, duration = clock["t0"], setup.load.duration_s
    slo_ms = {"ttft": setup.slo["ttftP99Ms"], "itl": setup.slo["itlP99Ms"]}
    windows = window_figures(records, duration, setup.window_s, slo_ms)
    timeline = [(round(t - t0, 1), pods, ready) for t, pods, ready in service.timeline if t - t0 <= duration + 60]
    events = [(e.get("lastTimestamp") or e.get("eventTime"), e["reason"], e["message"]) for e in live.events(name)
              if e["reason"] in ("ScaledOut", "ScaledIn", "KnobsChanged", "KnobsRolledBack")]
    figures = {
        "controller": controller, "name": name,
        "windows_within_slo": share_within(windows),
        "settled_within_slo": share_within(settled(windows, setup.load, setup.settle_s, setup.window_s)),
        "replica_s": round(service.pod_seconds(t0, t0 + duration), 1),
        "peak_pods": max((pods for _, pods, _ in timeline), default=0),
        "num_requests": len(records), "num_failed": sum(not r.ok for r in records),
        "errors": sorted({r.error_kind or "" for r in records if not r.ok}),
        "windows": windows, "timeline": timeline, "events": events,
        "hpa_changes": [(round(t - t0, 1), n) for t, n in player.changes] if player else [],
        "router_log": router_log.splitlines()[-20:],
        "conditions": [(round(t - t0, 1), kind, text) for t, kind, text in conditions.changes],
    }
    live.delete(name, service)
    return figures


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def print_row(f: dict) -> None:
    print(f"  {f['controller']:<10} windows {pct(f['windows_within_slo']):>6}  after convergence "
          f"{pct(f['settled_within_slo']):>6}  replica-s {f['replica_s']:>7.1f}  peak pods {f['peak_pods']}  "
          f"failed {f['num_failed']}/{f['num_requests']}", flush=True)
    marks = "".join("." if w["within_slo"] else ("x" if w["within_slo"] is False else " ") for w in f["windows"])
    print(f"             windows [{marks}]  pods {f['timeline']}", flush=True)


def summary(runs: list[dict]) -> list[dict]:
    out = []
    for controller in dict.fromkeys(r["controller"] for r in runs):
        mine = [r for r in runs if r["controller"] == controller]
        med = {k: statistics.median(r[k] for r in mine if r[k] is not None) if any(r[k] is not None for r in mine)
               else None for k in ("windows_within_slo", "settled_within_slo", "replica_s")}
        out.append({"controller": controller, "rounds": len(mine), **med,
                    "failed": sum(r["num_failed"] for r in mine), "requests": sum(r["num_requests"] for r in mine)})
    hpas = [s for s in out if s["controller"].startswith("hpa-")]
    passing = [s for s in hpas if (s["settled_within_slo"] or 0) >= 0.99]
    best = min(passing, key=lambda s: s["replica_s"]) if passing else \
        max(hpas, key=lambda s: s["settled_within_slo"] or 0, default=None)
    for s in out:
        s["replica_s_vs_best_hpa"] = round(s["replica_s"] / best["replica_s"], 2) if best and s["replica_s"] else None
        s["best_hpa"] = best is s
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    controllers = args.controllers.split(",")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="autoscaling-live-"))
    print(f"workdir: {workdir}", flush=True)
    live = Live(args, workdir)
    try:
        seqs, chunk = pair(args.start_knobs)
        engine = {"threads": args.threads, "maxModelLen": args.max_model_len, "kvCacheMemory": args.kv_cache_memory,
                  "maxNumSeqs": seqs, "prefillChunkSize": chunk}
        bounds = {"maxNumSeqs": {"min": 4, "max": 64}, "prefillChunkSize": {"min": 64, "max": 512}}
        base = Setup(model=args.model, engine=engine, bounds=bounds, slo={}, load=StepLoad(
            (), long_prompt=pair(args.long_prompt), output=pair(args.output), long_output=pair(args.long_output),
            seed=args.seed), window_s=args.window_s, settle_s=args.settle_s, max_replicas=args.max_replicas,
            scale_down_s=args.scale_down_s,
            tuning={"intervalSeconds": args.tuning_interval_s, "windowSeconds": args.tuning_window_s})
        quiet = alone(live, base)
        cap1 = overload_capacity(live, base, 1, args.calibrate_s, args.overload_rps)
        cap2 = overload_capacity(live, base, 2, args.calibrate_s, args.overload_rps)
        slo = {"ttftP99Ms": math.ceil(args.ttft_factor * quiet["ttft_long_ms"]),
               "itlP99Ms": math.ceil(args.itl_factor * quiet["itl_ms"])}
        rates = [float(x) * cap1 for x in args.rates.split(",")]
        phases = tuple(Phase(rate=r, duration_s=float(s)) for r, s in zip(rates, args.phase_s.split(","), strict=True))
        setup = Setup(**{**base.__dict__, "slo": slo, "load": StepLoad(phases, **{
            k: getattr(base.load, k) for k in ("long_prompt", "output", "long_output", "seed")})})
        calibration = {**quiet, "capacity_1_pod_rps": round(cap1, 2), "capacity_2_pods_rps": round(cap2, 2),
                       "slo": slo, "rates_rps": [round(r, 2) for r in rates]}
        print(f"calibration: {json.dumps(calibration)}", flush=True)
        if rates and max(rates) > 0.9 * cap2:
            print(f"  note: the peak ({max(rates):.2f}/s) is over 90% of what two pods finish here ({cap2:.2f}/s)")
        runs = []
        for rnd in range(args.rounds):
            order = controllers if rnd % 2 == 0 else controllers[::-1]
            print(f"round {rnd + 1}: {', '.join(order)}", flush=True)
            for controller in order:
                runs.append(run_one(live, setup, controller, f"{controller.replace('.', 'p')}-{rnd + 1}"))
                print_row(runs[-1])
        table = summary(runs)
        print("\nmedians over the rounds:")
        for s in table:
            print(f"  {s['controller']:<10} after convergence {pct(s['settled_within_slo']):>6}  all windows "
                  f"{pct(s['windows_within_slo']):>6}  replica-s {s['replica_s']:>7.1f}  "
                  f"vs best HPA {s['replica_s_vs_best_hpa']}{'  (best HPA)' if s['best_hpa'] else ''}  "
                  f"failed {s['failed']}/{s['requests']}")
        if args.json:
            args.json.write_text(json.dumps({"calibration": calibration, "runs": runs, "summary": table},
                                            indent=1, default=str))
    finally:
        live.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
