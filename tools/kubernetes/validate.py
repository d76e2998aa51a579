"""Checks the example Kubernetes manifests (deploy/kubernetes), offline.

    python tools/kubernetes/validate.py --kubernetes-version 1.32.0 deploy/kubernetes [--tinyflow PATH]

`cargo xtask k8s-validate` runs it with the tests' Python environment
(target/pyiceberg-venv), where `kubernetes-validate` is installed: a PyPI
package that carries the JSON schemas of every Kubernetes version it knows,
so nothing is downloaded at run time. Each file is checked:

- every resource against its kind's schema for the given Kubernetes version,
  strictly (a field the schema does not know is an error, so a typo is
  caught); a kind without a schema is an error too, not a warning;
- the Kustomization: every resource it lists exists, and every other manifest
  in the directory is listed;
- across files: the StatefulSet's replicas equal its TINYFLOW_WORKERS, the
  Secret and ConfigMap it names exist with the keys it takes, the ConfigMap
  holds job.toml, and the Service's port is the container's;
- with --tinyflow: `tinyflow validate` on the ConfigMap's job file, in the
  environment a pod of the StatefulSet gets (literal values, the Secret's
  placeholders, the pod's name for a field reference), so that every
  `${NAME}` the job file takes is set by the manifests.

Exits 1 naming every problem, 2 when kubernetes-validate is not installed.
"""

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile

try:
    import yaml
    from kubernetes_validate import utils as kv
except ImportError as e:
    print(
        f"k8s-validate: {e}: the validator is not installed; "
        "`cargo xtask py-setup` installs kubernetes-validate into target/pyiceberg-venv",
        file=sys.stderr,
    )
    sys.exit(2)


def load(directory):
    """Every manifest in `directory`: (file name, [resources])."""
    files = sorted(
        p for p in pathlib.Path(directory).iterdir() if p.suffix in (".yaml", ".yml")
    )
    if not files:
        raise SystemExit(f"k8s-validate: no manifests in {directory}")
    out = []
    for path in files:
        with open(path) as f:
            docs = [d for d in yaml.safe_load_all(f) if d is not None]
        out.append((path.name, docs))
    return out


def name_of(doc):
    meta = doc.get("metadata") or {}
    return f"{doc.get('kind', '?')}/{meta.get('name', '?')}"


def check_schema(file, doc, version, errors):
    try:
        kv.validate(doc, version, strict=True)
    except kv.ValidationError as e:
        path = ".".join(str(p) for p in e.path) or "(top)"
        errors.append(f"{file}: {name_of(doc)}: {path}: {e.message}")
    except kv.SchemaNotFoundError as e:
        errors.append(f"{file}: {name_of(doc)}: {e.message}")
    except kv.VersionNotSupportedError as e:
        raise SystemExit(f"k8s-validate: {e.message}")


def check_kustomization(file, doc, files, errors):
    listed = doc.get("resources") or []
    for r in listed:
        if r not in files:
            errors.append(f"{file}: resources: {r} is not in the directory")
    for f in files:
        if f != file and f not in listed:
            errors.append(f"{file}: resources: {f} is not listed, so `kubectl apply -k` leaves it out")


def by_kind(manifests, kind):
    return [doc for _, docs in manifests for doc in docs if doc.get("kind") == kind]


def container_env(container, secrets):
    """The environment a pod of the StatefulSet gets (literal values, the
    Secrets' data, the pod's name), and the problems found on the way."""
    env, problems = {}, []
    for e in container.get("env") or []:
        name = e["name"]
        if "value" in e:
            env[name] = str(e["value"])
            continue
        source = e.get("valueFrom") or {}
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            data = secrets.get(ref["name"])
            if data is None:
                problems.append(f"env {name}: no Secret {ref['name']}")
            elif ref["key"] not in data:
                problems.append(f"env {name}: Secret {ref['name']} has no key {ref['key']}")
            else:
                env[name] = data[ref["key"]]
        elif source.get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[name] = "tinyflow-0"
    return env, problems


def check_statefulset(manifests, errors, tinyflow):
    secrets = {}
    for s in by_kind(manifests, "Secret"):
        data = dict(s.get("stringData") or {})
        data.update({k: "(base64)" for k in (s.get("data") or {})})
        secrets[s["metadata"]["name"]] = data
    config_maps = {c["metadata"]["name"]: c.get("data") or {} for c in by_kind(manifests, "ConfigMap")}
    service_ports = {
        p.get("port") for s in by_kind(manifests, "Service") for p in s["spec"].get("ports") or []
    }
    for sts in by_kind(manifests, "StatefulSet"):
        where = name_of(sts)
        spec = sts["spec"]
        pod = spec["template"]["spec"]
        for volume in pod.get("volumes") or []:
            if "configMap" in volume and volume["configMap"]["name"] not in config_maps:
                errors.append(f"{where}: volume {volume['name']}: no ConfigMap {volume['configMap']['name']}")
            if "secret" in volume:
                data = secrets.get(volume["secret"]["secretName"])
                if data is None:
                    errors.append(f"{where}: volume {volume['name']}: no Secret {volume['secret']['secretName']}")
                else:
                    for item in volume["secret"].get("items") or []:
                        if item["key"] not in data:
                            errors.append(f"{where}: volume {volume['name']}: the Secret has no key {item['key']}")
        for container in pod["containers"]:
            env, problems = container_env(container, secrets)
            errors.extend(f"{where}: {p}" for p in problems)
            workers = env.get("TINYFLOW_WORKERS")
            if workers is not None and str(spec.get("replicas", 1)) != workers:
                errors.append(
                    f"{where}: replicas is {spec.get('replicas', 1)} but TINYFLOW_WORKERS is {workers}: "
                    "change them together (docs/kubernetes.md, Rescaling)"
                )
            for port in container.get("ports") or []:
                if service_ports and port["containerPort"] not in service_ports:
                    errors.append(f"{where}: port {port['containerPort']} is not the Service's ({sorted(service_ports)})")
            jobs = [data["job.toml"] for data in config_maps.values() if "job.toml" in data]
            if not jobs:
                errors.append(f"{where}: no ConfigMap holds job.toml")
            elif tinyflow:
                validate_job(where, jobs[0], env, tinyflow, errors)


def validate_job(where, job, env, tinyflow, errors):
    """`tinyflow validate` on the job file, in the pod's environment."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "job.toml")
        with open(path, "w") as f:
            f.write(job)
        run_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env}
        out = subprocess.run(
            [tinyflow, "validate", path], env=run_env, capture_output=True, text=True
        )
        if out.returncode != 0:
            errors.append(
                f"{where}: `tinyflow validate` refused the ConfigMap's job.toml (exit {out.returncode}): "
                + (out.stderr.strip() or out.stdout.strip())
            )
        else:
            print(f"k8s-validate: `tinyflow validate` accepts the ConfigMap's job.toml in the pod's environment")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kubernetes-version", required=True)
    parser.add_argument("--tinyflow", help="also run `tinyflow validate` on the job file")
    parser.add_argument("directory")
    args = parser.parse_args()

    manifests = load(args.directory)
    files = [f for f, _ in manifests]
    errors = []
    count = 0
    for file, docs in manifests:
        if not docs:
            errors.append(f"{file}: no resource in it")
        for doc in docs:
            count += 1
            if doc.get("kind") == "Kustomization":
                check_kustomization(file, doc, files, errors)
            else:
                check_schema(file, doc, args.kubernetes_version, errors)
    check_statefulset(manifests, errors, args.tinyflow)
    for e in errors:
        print(f"k8s-validate: ERROR {e}", file=sys.stderr)
    if errors:
        print(f"k8s-validate: {len(errors)} problem(s) in {args.directory}", file=sys.stderr)
        return 1
    print(
        f"k8s-validate: {count} resources in {len(files)} files valid against Kubernetes "
        f"{args.kubernetes_version} (strict schemas of kubernetes-validate {kv.__version__})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
