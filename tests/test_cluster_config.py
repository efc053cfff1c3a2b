"""The Ray cluster configs: ``configs/serve.yaml`` (``serve deploy``) and ``configs/kuberay-rayservice.yaml``
(KubeRay ``RayService`` with the same ``serveConfigV2``) are valid, point at an importable application builder
with a valid profile, and ask for the resources ``configs/gpu.yaml`` gives each deployment. No Ray started."""

from __future__ import annotations

import importlib
import math

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from services.profiles import CONFIG_DIR, ProfileError, load_profile

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
        return total + prof.video.engine.jobs.gpus_per_job  # at least one video job at a time

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
    from services.memory_plan import PlanError

    data = load_profile("gpu").model_dump(mode="json")
    data["ray"]["gpu_memory_gib"] = 16
    prof = tmp_path / "small.yaml"
    prof.write_text(yaml.safe_dump(data))
    with pytest.raises(PlanError, match=r"does not fit its GPUs(.|\n)*GPU 3: 2\d\.\d\d GiB > 16\.00 GiB"):
        app_builder({"profile": str(prof)})
