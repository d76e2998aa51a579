"""A small Confluent-compatible schema registry, for tests only.

No real schema registry installs from the package registries this project
builds from (Confluent's is not on Maven Central or PyPI; Karapace is not on
PyPI; Apicurio's server does not resolve from Maven Central), so the tests run
this one. It answers the REST calls Confluent's clients make (the ones
confluent-kafka's serializers and tinyflow's registry client use), with the
same paths, bodies, error codes and content type, so producers in the tests
use the ordinary Confluent serializers against it and write the ordinary wire
format. It never ships in the product.

What it does: subjects with versions, global schema ids (the same schema text
registered under two subjects gets one id, as Confluent's does), lookups,
schema types (AVRO, PROTOBUF, JSON) and references, optional HTTP basic
authentication, and state kept in a JSON file so a restart keeps every id (a
real registry keeps them in its `_schemas` topic). What it does not do:
compatibility checks (every schema is accepted), deletes, contexts, modes
other than READWRITE.

    python registry.py --port 0 --state DIR/registry.json [--user NAME:PASSWORD] [--tls-dir DIR]

prints `listening on <port>` once it accepts connections, then serves until
SIGTERM or SIGINT. With `--tls-dir` it serves HTTPS with a certificate for
127.0.0.1 signed by a CA it makes, whose certificate it writes to
`DIR/ca.pem` for clients to trust (the same CA and certificate on a restart).
"""

import argparse
import base64
import json
import os
import re
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"


class Registry:
    """Subjects, versions and ids, saved to `path` after every change."""

    def __init__(self, path):
        self.path = path
        self.lock = threading.Lock()
        self.schemas = []  # id - 1 -> {"schema", "schemaType", "references"}
        self.subjects = {}  # subject -> [id of version 1, id of version 2, ...]
        if path and os.path.exists(path):
            with open(path) as f:
                state = json.load(f)
            self.schemas = state["schemas"]
            self.subjects = state["subjects"]

    def save(self):
        if not self.path:
            return
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"schemas": self.schemas, "subjects": self.subjects}, f)
        os.replace(tmp, self.path)

    @staticmethod
    def canonical(body):
        kind = body.get("schemaType") or "AVRO"
        text = body.get("schema")
        if not isinstance(text, str):
            raise Problem(422, 42201, "schema must be a string")
        if kind in ("AVRO", "JSON"):
            try:
                text = json.dumps(json.loads(text), separators=(",", ":"), sort_keys=True)
            except ValueError as e:
                raise Problem(422, 42201, f"Invalid schema: {e}")
        elif kind != "PROTOBUF":
            raise Problem(422, 42201, f"Invalid schema type {kind}")
        refs = [
            {"name": r["name"], "subject": r["subject"], "version": r["version"]}
            for r in body.get("references") or []
        ]
        return {"schema": text, "schemaType": kind, "references": refs}

    def id_of(self, entry):
        for i, known in enumerate(self.schemas):
            if known == entry:
                return i + 1
        return None

    def register(self, subject, body):
        entry = self.canonical(body)
        with self.lock:
            schema_id = self.id_of(entry)
            if schema_id is None:
                self.schemas.append(entry)
                schema_id = len(self.schemas)
            versions = self.subjects.setdefault(subject, [])
            if schema_id not in versions:
                versions.append(schema_id)
            self.save()
            return self.version(subject, versions.index(schema_id) + 1)

    def lookup(self, subject, body):
        entry = self.canonical(body)
        with self.lock:
            versions = self.subjects.get(subject)
            if versions is None:
                raise Problem(404, 40401, f"Subject '{subject}' not found.")
            schema_id = self.id_of(entry)
            if schema_id not in versions:
                raise Problem(404, 40403, "Schema not found")
            return self.version(subject, versions.index(schema_id) + 1)

    def version(self, subject, version):
        versions = self.subjects.get(subject)
        if versions is None:
            raise Problem(404, 40401, f"Subject '{subject}' not found.")
        if version == "latest":
            version = len(versions)
        try:
            version = int(version)
        except ValueError:
            raise Problem(422, 42202, f"Invalid version {version}")
        if not 1 <= version <= len(versions):
            raise Problem(404, 40402, f"Version {version} not found.")
        schema_id = versions[version - 1]
        out = {"subject": subject, "version": version, "id": schema_id}
        out.update(self.by_id(schema_id))
        return out

    def by_id(self, schema_id):
        if not 1 <= schema_id <= len(self.schemas):
            raise Problem(404, 40403, "Schema not found")
        entry = self.schemas[schema_id - 1]
        out = {"schema": entry["schema"]}
        if entry["schemaType"] != "AVRO":
            out["schemaType"] = entry["schemaType"]
        if entry["references"]:
            out["references"] = entry["references"]
        return out


class Problem(Exception):
    def __init__(self, status, code, message):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def handler(registry, user):
    expected = None
    if user:
        expected = "Basic " + base64.b64encode(user.encode()).decode()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):
            sys.stderr.write("registry: " + (fmt % args) + "\n")

        def reply(self, status, body):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def body(self):
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b"{}"
            try:
                return json.loads(raw)
            except ValueError as e:
                raise Problem(400, 400, f"Unrecognized JSON: {e}")

        def route(self, method):
            if expected is not None and self.headers.get("Authorization") != expected:
                raise Problem(401, 401, "Unauthorized")
            parts = [unquote(p) for p in urlsplit(self.path).path.strip("/").split("/") if p]
            match (method, parts):
                case ("GET", []):
                    return {}
                case ("GET", ["schemas", "types"]):
                    return ["AVRO", "PROTOBUF", "JSON"]
                case ("GET", ["schemas", "ids", i]) if re.fullmatch(r"\d+", i):
                    return registry.by_id(int(i))
                case ("GET", ["schemas", "ids", i, "subjects"]) if re.fullmatch(r"\d+", i):
                    return [s for s, v in registry.subjects.items() if int(i) in v]
                case ("GET", ["schemas", "ids", i, "versions"]) if re.fullmatch(r"\d+", i):
                    return [
                        {"subject": s, "version": v.index(int(i)) + 1}
                        for s, v in registry.subjects.items()
                        if int(i) in v
                    ]
                case ("GET", ["subjects"]):
                    return sorted(registry.subjects)
                case ("GET", ["subjects", s, "versions"]):
                    registry.version(s, 1)
                    return list(range(1, len(registry.subjects[s]) + 1))
                case ("GET", ["subjects", s, "versions", v]):
                    return registry.version(s, v)
                case ("GET", ["subjects", s, "versions", v, "schema"]):
                    return json.loads(registry.version(s, v)["schema"])
                case ("POST", ["subjects", s, "versions"]):
                    return registry.register(s, self.body())
                case ("POST", ["subjects", s]):
                    return registry.lookup(s, self.body())
                case ("GET", ["config"] | ["config", _]):
                    return {"compatibilityLevel": "NONE"}
                case ("PUT", ["config"] | ["config", _]):
                    return self.body()
                case ("GET", ["mode"] | ["mode", _]):
                    return {"mode": "READWRITE"}
            raise Problem(404, 404, f"HTTP 404 Not Found: {method} {self.path}")

        def serve(self, method):
            try:
                self.reply(200, self.route(method))
            except Problem as p:
                self.reply(p.status, {"error_code": p.code, "message": p.message})

        def do_GET(self):
            self.serve("GET")

        def do_POST(self):
            self.serve("POST")

        def do_PUT(self):
            self.serve("PUT")

    return Handler


def tls_context(directory):
    """An HTTPS context for 127.0.0.1 from a CA made once in `directory`."""
    import datetime
    import ipaddress
    import ssl

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    os.makedirs(directory, exist_ok=True)
    cert_path = os.path.join(directory, "server.pem")
    key_path = os.path.join(directory, "server.key")
    if not os.path.exists(cert_path):
        now = datetime.datetime.now(datetime.timezone.utc)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tinyflow test registry CA")])
        ca = (
            x509.CertificateBuilder()
            .subject_name(ca_name)
            .issuer_name(ca_name)
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
            )
            .sign(ca_key, hashes.SHA256())
        )
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False,
            )
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        with open(os.path.join(directory, "ca.pem"), "wb") as f:
            f.write(ca.public_bytes(serialization.Encoding.PEM))
        with open(cert_path, "wb") as f:
            f.write(cert.public_bytes(serialization.Encoding.PEM))
        with open(key_path, "wb") as f:
            f.write(
                key.private_bytes(
                    serialization.Encoding.PEM,
                    serialization.PrivateFormat.PKCS8,
                    serialization.NoEncryption(),
                )
            )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_path, key_path)
    return context


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--state", help="JSON file the registry is kept in")
    parser.add_argument("--user", help="NAME:PASSWORD that HTTP basic auth requires")
    parser.add_argument("--tls-dir", help="serve HTTPS; the CA's certificate goes to DIR/ca.pem")
    args = parser.parse_args()
    registry = Registry(args.state)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), handler(registry, args.user))
    if args.tls_dir:
        server.socket = tls_context(args.tls_dir).wrap_socket(server.socket, server_side=True)
    server.daemon_threads = True
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    print(f"listening on {server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
