"""One operator, hundreds of LLMServices, on the real apiserver of the tests (issue 29).

Starts etcd + kube-apiserver + kube-controller-manager on loopback (tests/kube_support.py), the manifests'
RBAC, `iterserve operator --all-namespaces --standalone` as a subprocess with the operator's RBAC-only
kubeconfig, the LOAD-TEST STAND-IN that answers every pod's /metrics and admin API
(benchmarks/metrics_standin.py), and the Ready marker (benchmarks/fleet_harness.py). Then it creates
`--services` LLMServices (tuning `observe`, so every pod is scraped) over `--namespaces` namespaces and
measures:

- settle: from the first create until every service is Ready, and until every one is Tuned (its pods
  scraped over a full window; the stand-in's latencies meet the SLO);
- reconcile latency of a spec change: `spec.engine.maxNumSeqs` patched on `--changes` services, one every
  `--change-interval-s` (0: all at once), until status.observedGeneration catches up, and until the pod
  got the knob live (the stand-in's PATCH);
- the tuners' scrape fan-out: the most scrapes in flight the stand-in saw, against the operator's bound;
- the operator's resident memory after settling, after the idle minute and at the end (and its peak);
- apiserver requests per minute while idle: all clients' (`apiserver_request_total` deltas over
  `--idle-s`), and per client from the apiserver's audit log, the operator's by verb and resource (a watch
  counts when opened: a watch storm shows as watches and lists re-opened every minute).

Targets (issue 29): p99 reconcile < 5 s, memory < 500 MiB, no watch storms. A benchmark: it prints figures
and asserts nothing about speed. `--json` writes the figures for tests/test_operator_scale_smoke.py.

    python benchmarks/operator_scale.py                       # 200 services, 4 namespaces
    python benchmarks/operator_scale.py --services 10 --namespaces 2 --idle-s 10   # a quick run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `benchmarks.*` and `tests.*`, run as a file

import httpx  # noqa: E402
import kubernetes  # noqa: E402
import yaml  # noqa: E402

from benchmarks.fleet_harness import AuditWindow, GenerationWatch, PodMarker, apiserver_requests, memory_mib  # noqa: E402
from iterserve.operator.constants import DEFAULT_MAX_CONCURRENT_SCRAPES, GROUP, PLURAL, VERSION  # noqa: E402
from tests.kube_processes import DaemonProcess  # noqa: E402
from tests.kube_support import OPERATOR_USER, start_cluster  # noqa: E402
from tests.operator_support import log_of, rendered_manifests, start_operator  # noqa: E402
from tests.server_support import free_port  # noqa: E402
from tests.waiting import wait_until  # noqa: E402

NEW_MAX_NUM_SEQS = 48  # the spec change: not the default (64), within every bound
LIVE_WAIT_S = 120.0  # after every status caught up, the longest wait for the knob on the pods


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--services", type=int, default=200)
    p.add_argument("--namespaces", type=int, default=4)
    p.add_argument("--changes", type=int, default=None, help="services whose spec is changed (default: all)")
    p.add_argument("--change-interval-s", type=float, default=0.5,
                   help="seconds between two spec changes; 0 patches them all at once")
    p.add_argument("--idle-s", type=float, default=60.0, help="the idle window the apiserver requests are counted in")
    p.add_argument("--max-concurrent-scrapes", type=int, default=DEFAULT_MAX_CONCURRENT_SCRAPES)
    p.add_argument("--tuning-interval-s", type=int, default=30,
                   help="spec.tuning.intervalSeconds (default: its default)")
    p.add_argument("--resync-seconds", type=float, default=30.0, help="the operator's flag (default: its default)")
    p.add_argument("--scrape-delay-ms", type=float, default=20.0, help="how long the stand-in takes per /metrics")
    p.add_argument("--timeout-s", type=float, default=900.0, help="the longest wait for any phase")
    p.add_argument("--workdir", type=Path, default=None, help="logs and the cluster's files (default: a temp dir)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    return p.parse_args(argv)


def llmservice(namespace: str, name: str, tuning_interval_s: int) -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "LLMService",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"tuning": {"mode": "observe", "intervalSeconds": tuning_interval_s},
                     "slo": {"ttftP99Ms": 1000, "itlP99Ms": 100}}}


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ranked = sorted(values)
    return ranked[max(0, min(len(ranked) - 1, round(q / 100 * len(ranked) + 0.5) - 1))]


class Run:
    """One scale test: the cluster, the processes around the operator, and the figures as they come."""

    def __init__(self, args: argparse.Namespace, workdir: Path):
        self.args, self.workdir = args, workdir
        self.figures: dict = {"services": args.services, "namespaces": args.namespaces,
                              "max_concurrent_scrapes": args.max_concurrent_scrapes}
        self.cluster = start_cluster(workdir / "kube", audit_log=workdir / "kube" / "audit.log")
        self.audit = AuditWindow(workdir / "kube" / "audit.log")
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        args, workdir = self.args, self.workdir
        self.client = self.cluster.api_client()
        self.custom = kubernetes.client.CustomObjectsApi(self.client)
        docs = [doc for doc in rendered_manifests() if doc["kind"] != "Deployment"]
        self.cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
        control_port = free_port()
        self.standin_url = f"http://127.0.0.1:{control_port}"
        self.standin = DaemonProcess.start("metrics stand-in", [
            sys.executable, "-m", "benchmarks.metrics_standin", "--control-port", str(control_port),
            "--scrape-delay-ms", str(args.scrape_delay_ms)], workdir / "metrics-standin.log", cwd=ROOT)
        wait_until(self._standin_up, timeout=60, what="the metrics stand-in", fail_if=self._exited)
        self.marker = PodMarker(self.client, self.standin_url, self.standin.pid).start()
        self.generations = GenerationWatch(self.client).start()
        self.operator = start_operator(self.cluster, None, "--standalone", "--max-concurrent-scrapes",
                                       str(args.max_concurrent_scrapes), resync_seconds=args.resync_seconds)
        names = [f"fleet-{i}" for i in range(args.namespaces)]
        self.services = [(names[i % len(names)], f"llm-{i:03d}") for i in range(args.services)]

    def _standin_up(self) -> bool:
        try:
            return httpx.get(f"{self.standin_url}/stats", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def _exited(self) -> str | None:
        for process in (self.standin, getattr(self, "operator", None)):
            if process is not None and process.exit_code() is not None:
                return f"{process.name} exited with {process.exit_code()}:\n{process.log_tail()}"
        return None

    def stats(self) -> dict:
        return httpx.get(f"{self.standin_url}/stats", timeout=30).json()

    def wait(self, predicate, what: str):
        return wait_until(predicate, timeout=self.args.timeout_s, what=what, interval=1.0, fail_if=self._exited)

    def create_fleet(self) -> None:
        core = kubernetes.client.CoreV1Api(self.client)
        for namespace in sorted({ns for ns, _ in self.services}):
            core.create_namespace({"metadata": {"name": namespace}})
        started = time.time()
        for namespace, name in self.services:
            self.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                        llmservice(namespace, name, self.args.tuning_interval_s))
        self.wait(lambda: self.generations.all_true(self.services, "Ready"), "every service Ready")
        self.figures["ready_s"] = time.time() - started
        # the stand-in's load meets the SLO: Tuned=True once a service's first window is full
        self.wait(lambda: self.generations.all_true(self.services, "Tuned"), "every service Tuned")
        self.figures["settled_s"] = time.time() - started
        self.figures["memory_settled_mib"] = memory_mib(self.operator.pid)

    def idle_minute(self) -> None:
        before = apiserver_requests(self.client)
        self.audit.start()
        time.sleep(self.args.idle_s)
        by_user = self.audit.stop()
        after = apiserver_requests(self.client)
        per_minute = 60.0 / self.args.idle_s
        self.figures["idle_apiserver_per_min"] = (sum(after.values()) - sum(before.values())) * per_minute
        users: dict[str, float] = {}
        operator: dict[str, float] = {}
        for (user, verb, resource), count in by_user.items():
            users[user] = users.get(user, 0.0) + count * per_minute
            if user == OPERATOR_USER:
                operator[f"{verb} {resource}"] = count * per_minute
        self.figures["idle_per_min_by_user"] = dict(sorted(users.items(), key=lambda kv: -kv[1]))
        self.figures["idle_operator_per_min"] = dict(sorted(operator.items(), key=lambda kv: -kv[1]))
        self.figures["memory_idle_mib"] = memory_mib(self.operator.pid)

    def spec_change(self) -> None:
        changed = self.services[:self.args.changes or len(self.services)]
        patched: dict[tuple[str, str], tuple[float, int]] = {}  # key -> (wall clock, generation)
        for namespace, name in changed:
            obj = self.custom.patch_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name, {"spec": {"engine": {"maxNumSeqs": NEW_MAX_NUM_SEQS}}})
            patched[(namespace, name)] = (time.time(), obj["metadata"]["generation"])
            time.sleep(self.args.change_interval_s)
        self.wait(lambda: all(self.generations.caught_up(k, g) for k, (_, g) in patched.items()),
                  "observedGeneration of every changed service")
        reconcile = [self.generations.caught_up(k, g) - t for k, (t, g) in patched.items()]
        host_of = {key: host for host, key in self.marker.hosts.items()}
        live: dict[tuple[str, str], float] = {}

        def pods_patched() -> bool:
            for patch in self.stats()["knob_patches"]:
                key = self.marker.hosts.get(patch["host"])
                if key in patched and patch["knobs"].get("max_num_seqs") == NEW_MAX_NUM_SEQS:
                    live.setdefault(key, patch["t"])
            return len(live) == len(patched)

        # bounded: a pod the harness failed to mark (an apiserver error while it wrote the pod's status) is
        # not known by its address, and its knob would be waited for until --timeout-s
        try:
            wait_until(pods_patched, timeout=LIVE_WAIT_S, what="the new maxNumSeqs live on every changed pod",
                       interval=1.0, fail_if=self._exited)
        except TimeoutError:
            print(f"knob live seen on {len(live)} of {len(patched)} changed pods after {LIVE_WAIT_S:.0f} s",
                  flush=True)
        live_latency = [live[k] - patched[k][0] for k in live if k in host_of]
        self.figures["changes"] = len(patched)
        self.figures["change_interval_s"] = self.args.change_interval_s
        self.figures["reconcile_s"] = {"p50": statistics.median(reconcile), "p99": percentile(reconcile, 99),
                                       "max": max(reconcile)}
        self.figures["live_knob_seen"] = len(live)
        self.figures["live_knob_s"] = {"p50": statistics.median(live_latency), "p99": percentile(live_latency, 99),
                                       "max": max(live_latency)}
        self.figures["reconciled"] = sorted(f"{ns}/{name}" for ns, name in patched)

    def finish(self) -> None:
        stats = self.stats()
        scrapes = [stats["scrapes"].get(host, 0) for host in self.marker.hosts]
        self.figures["scrapes"] = {"total": sum(scrapes), "pods": len(scrapes), "min_per_pod": min(scrapes),
                                   "max_in_flight": stats["max_in_flight"]}
        self.figures["memory_end_mib"] = memory_mib(self.operator.pid)
        self.figures["operator_log_errors"] = sum("ERROR" in line or "forbidden" in line.lower()
                                                  for line in log_of(self.operator).splitlines())

    def close(self) -> None:
        for thread in (getattr(self, "marker", None), getattr(self, "generations", None)):
            if thread is not None:
                thread.stop()
        for process in (getattr(self, "operator", None), getattr(self, "standin", None)):
            if process is not None:
                process.stop()
        self.cluster.stop()


def print_table(f: dict) -> None:
    def target(value: float, limit: float) -> str:
        return f"met ({value / limit:.0%} of the target)" if value < limit else f"MISSED by {value - limit:.2f}"

    rec, live, mem = f["reconcile_s"], f["live_knob_s"], f["memory_end_mib"]
    peak = max(f["memory_settled_mib"]["peak"], f["memory_idle_mib"]["peak"], mem["peak"])
    idle = f["idle_operator_per_min"]
    watches = sum(v for k, v in idle.items() if k.startswith("watch "))
    lists = sum(v for k, v in idle.items() if k.startswith("list "))
    rows = [
        ("services / namespaces", f"{f['services']} / {f['namespaces']}", ""),
        ("create -> all Ready", f"{f['ready_s']:.1f} s", ""),
        ("create -> all Tuned (a full window scraped)", f"{f['settled_s']:.1f} s", ""),
        (f"reconcile p50 / p99 / max ({f['changes']} changes, every {f['change_interval_s']} s)",
         f"{rec['p50']:.2f} / {rec['p99']:.2f} / {rec['max']:.2f} s", "p99 < 5 s: " + target(rec["p99"], 5.0)),
        (f"knob live on the pod p50 / p99 / max ({f['live_knob_seen']} pods seen)",
         f"{live['p50']:.2f} / {live['p99']:.2f} / {live['max']:.2f} s", ""),
        ("scrapes in flight, most / bound", f"{f['scrapes']['max_in_flight']} / {f['max_concurrent_scrapes']}",
         "within" if f["scrapes"]["max_in_flight"] <= f["max_concurrent_scrapes"] else "EXCEEDED"),
        ("scrapes total (min per pod)", f"{f['scrapes']['total']} ({f['scrapes']['min_per_pod']})", ""),
        ("operator RSS settled / idle / end", " / ".join(
            f"{rss:.0f}" for rss in (f["memory_settled_mib"]["rss"], f["memory_idle_mib"]["rss"], mem["rss"])) + " MiB",
         ""),
        ("operator RSS peak", f"{peak:.0f} MiB", "< 500 MiB: " + target(peak, 500.0)),
        ("apiserver requests/min idle, all clients", f"{f['idle_apiserver_per_min']:.0f}", ""),
        ("  the operator's", f"{sum(idle.values()):.0f}", ""),
        ("  the operator's watches opened / lists", f"{watches:.0f} / {lists:.0f}",
         "no watch storm" if watches <= 1 else "watches re-opened: check"),
    ]
    width = max(len(r[0]) for r in rows)
    for name, value, verdict in rows:
        print(f"{name:<{width}}  {value:<28} {verdict}")
    print("\nidle apiserver requests/min by client:")
    for key, value in f["idle_per_min_by_user"].items():
        print(f"  {key:<64} {value:8.1f}")
    print("the operator's, by verb and resource:")
    for key, value in idle.items():
        print(f"  {key:<64} {value:8.1f}")


def main(argv=None) -> int:
    args = parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="operator-scale-"))
    print(f"operator scale test: {args.services} services in {args.namespaces} namespaces; logs in {workdir}",
          flush=True)
    run = Run(args, workdir)
    try:
        run.create_fleet()
        print(f"settled: all Ready in {run.figures['ready_s']:.1f} s", flush=True)
        print(f"all Tuned in {run.figures['settled_s']:.1f} s; the idle window ({args.idle_s:.0f} s)", flush=True)
        run.idle_minute()
        print(f"the spec changes ({args.changes or args.services}, every {args.change_interval_s} s)", flush=True)
        run.spec_change()
        run.finish()
    finally:
        run.close()
    if args.json:
        args.json.write_text(json.dumps(run.figures, indent=2))
    print_table(run.figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
