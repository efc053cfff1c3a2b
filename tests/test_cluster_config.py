"""The Ray cluster configs: ``configs/serve.yaml`` (``serve deploy``) and ``configs/kuberay-rayservice.yaml``
(KubeRay ``RayService`` with the same ``serveConfigV2``) are valid, point at an importable application builder
with a valid profile, and ask for the resources ``configs/gpu.yaml`` gives each deployment (no Ray started), and
``chimera serve --address`` joins a running cluster (the last test: it starts a small Ray cluster and an
ingress-only application, so it runs under the e2e lock)."""

from __future__ import annotations

import importlib
import math

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from services.config.profiles import CONFIG_DIR, ProfileError, load_profile

SERVE = yaml.safe_load((CONFIG_DIR / "serve.yaml").read_text())
KUBE = yaml.safe_load((CONFIG_DIR / "kuberay-rayservice.yaml").read_text())


def _builder(import_path: str):
    module, attr = import_path.split(":")
    return getattr(importlib.import_module(module), attr)


def test_serve_config_is_a_valid_serve_deploy_file_with_an_importable_builder():
    schema = ServeDeploySchema.model_validate(SERVE)  # Ray's own schema for `serve deploy`
    (app,) = schema.applications
    assert app.name == "chimera" and app.route_prefix == "/"
    builder = _builder(app.import_path)
    assert callable(builder) and builder.__name__ == "app_builder"
    prof = load_profile(app.args["profile"])
    assert prof.name == "gpu"
    h = SERVE["http_options"]
    assert (h["host"], h["port"], h["request_timeout_s"]) == (prof.server.host, prof.server.port,
                                                              prof.server.request_timeout_s)


def test_every_deployment_asks_for_what_the_gpu_profile_gives_it():
    prof = load_profile("gpu")
    deps = {d["name"]: d for d in SERVE["applications"][0]["deployments"]}
    sections = {**{f: s.deployment for f, s in prof.families().items()}, "ingress": prof.server.ingress}
    assert set(deps) == set(sections)
    for name, o in sections.items():
        d = deps[name]
        assert d["ray_actor_options"] == {"num_cpus": o.num_cpus, "num_gpus": o.num_gpus}, name
        assert (d["max_ongoing_requests"], d["max_queued_requests"]) == (o.max_ongoing_requests,
                                                                        o.max_queued_requests), name
        a = d.get("autoscaling_config")
        if a is None:
            assert d["num_replicas"] == o.num_replicas, name
        else:  # scale on requests in flight per replica, from the profile's replica count up
            assert a["min_replicas"] == o.num_replicas <= a["max_replicas"], name
            assert 0 < a["target_ongoing_requests"] <= o.max_ongoing_requests, name
            assert "num_replicas" not in d, name
    assert deps["video"]["num_replicas"] == 1  # one front for the single job manager; jobs get GPUs themselves
    assert deps["vlm"]["ray_actor_options"]["num_gpus"] == prof.vlm.engine.vllm.tensor_parallel_size
    assert all(d["max_queued_requests"] > 0 for n, d in deps.items() if n != "ingress")  # back-pressure: 429


def test_kuberay_rayservice_carries_the_same_serve_config_and_enough_gpus():
    assert (KUBE["apiVersion"], KUBE["kind"]) == ("ray.io/v1", "RayService")
    spec = KUBE["spec"]
    assert yaml.safe_load(spec["serveConfigV2"]) == SERVE
    cluster = spec["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    import ray

    assert cluster["rayVersion"] == ray.__version__
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    (gpu,) = cluster["workerGroupSpecs"]
    (c,) = gpu["template"]["spec"]["containers"]
    per_pod = int(c["resources"]["limits"]["nvidia.com/gpu"])
    assert int(gpu["rayStartParams"]["num-gpus"]) == per_pod == int(c["resources"]["requests"]["nvidia.com/gpu"])
    prof = load_profile("gpu")
    deps = {d["name"]: d for d in SERVE["applications"][0]["deployments"]}

    def gpus(which: str) -> float:
        total = 0.0
        for d in deps.values():
            n = d["num_replicas"] if "num_replicas" in d else d["autoscaling_config"][which]
            total += n * d["ray_actor_options"]["num_gpus"]
        jobs = prof.video.engine.jobs
        return total + jobs.workers * jobs.gpus_per_job  # the job workers hold theirs all the time

    # the minimum fits the minimum number of workers (and the profile's ray.num_gpus), the maximum the maximum
    assert gpus("min_replicas") <= gpu["minReplicas"] * per_pod and gpus("min_replicas") <= prof.ray.num_gpus
    assert gpus("max_replicas") <= gpu["maxReplicas"] * per_pod
    # a replica never spans workers: each one's GPUs fit one pod
    assert max(math.ceil(d["ray_actor_options"]["num_gpus"]) for d in deps.values()) <= per_pod
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert str(prof.model_dir) in mounts  # the profile's model_dir is on every worker
    env = {e["name"]: e["value"] for e in c["env"]}
    from services.serve_app import PROXY_CALLBACK

    assert env["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] == PROXY_CALLBACK


def test_app_builder_binds_the_profile_and_refuses_bad_args():
    from ray.serve import Application

    from services.cluster import app_builder

    assert isinstance(app_builder({"profile": "cpu"}), Application)  # binding only: nothing starts
    with pytest.raises(ValueError, match=r"unknown application args \['profle'\]"):
        app_builder({"profle": "gpu"})
    with pytest.raises(ProfileError, match="profile 'nope' not found"):
        app_builder({"profile": "nope"})


def test_app_builder_refuses_a_profile_that_does_not_fit(tmp_path):
    from services.cluster import app_builder
    from services.config.memory_plan import PlanError

    data = load_profile("gpu").model_dump(mode="json")
    data["ray"]["gpu_memory_gib"] = 16
    prof = tmp_path / "small.yaml"
    prof.write_text(yaml.safe_dump(data))
    with pytest.raises(PlanError, match=r"does not fit its GPUs(.|\n)*GPU 3: 2\d\.\d\d GiB > 16\.00 GiB"):
        app_builder({"profile": str(prof)})


HOLDER = """
import signal, sys, time
import ray
ray.init(num_cpus=2, include_dashboard=False)
print(ray.get_runtime_context().gcs_address, flush=True)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # exit runs ray.shutdown: the cluster ends with this process
while True:
    time.sleep(1)
"""
STATUS = """
import sys
import ray
from ray import serve
ray.init(address=sys.argv[1], log_to_driver=False)
print(sorted(serve.status().applications))
"""


def test_serve_address_joins_a_running_cluster_and_leaves_it_running(tmp_path):
    """`chimera serve --address <gcs>` deploys onto a cluster another process started (the application shows in
    that cluster's Serve status), and SIGTERM deletes only the application: the cluster and its Serve stay up.
    A profile without model families (ingress only) keeps it to a few seconds. Needs the e2e lock."""
    import os
    import signal
    import subprocess
    import sys

    import httpx

    from services.api.readiness import wait_ready
    from tests.conftest import free_port

    # Ray 2.60's local clusters use token auth (~/.ray/auth_token); a driver given an explicit address uses it only
    # with RAY_AUTH_MODE=token (README "Running on a Ray cluster").
    env = {**os.environ, "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "services.api.edge:proxy_middlewares",
           "RAY_AUTH_MODE": "token"}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True, env=env,
                              start_new_session=True)
    serve_proc = None
    try:
        gcs = holder.stdout.readline().strip()
        assert gcs, "the holder did not start a cluster"
        port = free_port()
        prof = tmp_path / "join.yaml"
        prof.write_text(yaml.safe_dump({"name": "join", "model_dir": str(tmp_path), "ray": {"num_cpus": 1},
                                        "server": {"port": port, "ingress": {"num_cpus": 0.1}}}))
        serve_proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "--profile", str(prof),
                                       "--address", gcs], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, env=env, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, 300, alive=lambda: serve_proc.poll() is None)
        except RuntimeError:
            serve_proc.kill()
            raise AssertionError(serve_proc.communicate(timeout=60)[0][-4000:]) from None
        assert httpx.get(f"{url}/v1/models", timeout=10).json()["data"] == []
        status = [sys.executable, "-c", STATUS, gcs]
        assert subprocess.run(status, capture_output=True, text=True, timeout=300, env=env).stdout.strip() \
            == "['chimera']"
        serve_proc.send_signal(signal.SIGTERM)
        out, _ = serve_proc.communicate(timeout=300)
        assert serve_proc.returncode == 0, out
        assert holder.poll() is None  # the cluster is still running
        assert subprocess.run(status, capture_output=True, text=True, timeout=300, env=env).stdout.strip() == "[]"
    finally:
        for p in (serve_proc, holder):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=120)
