# syntax=docker/dockerfile:1
#
# The `tinyflow` binary in a small image that runs as a non-root user.
#
#   docker build -t tinyflow:0.1.0 .
#   docker run --rm tinyflow:0.1.0 --help
#
# (podman and buildah take the same file.) See docs/kubernetes.md, "Building
# the image".
#
# The builder stage needs cmake, perl, make and g++ besides Rust: librdkafka
# is built from source with its cmake build, and so are OpenSSL, libcurl and
# zstd (the rdkafka crate's `ssl-vendored` and `curl-static`; see
# ARCHITECTURE.md, crates/connectors-kafka). The binary then needs no libssl
# or libcurl at run time; it links libc, libm, libgcc_s and libz (zlib, which
# librdkafka's gzip codec takes from the system) dynamically. A clean build
# takes several minutes (librdkafka and OpenSSL alone about four).

ARG RUST_VERSION=1.95
ARG DEBIAN_RELEASE=bookworm

FROM rust:${RUST_VERSION}-${DEBIAN_RELEASE} AS builder
RUN apt-get update \
    && apt-get install -y --no-install-recommends cmake perl make g++ \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# The cache mounts keep the registry and the target directory between builds
# of the image (BuildKit, podman and buildah have them); the binary is copied
# out of the cached target directory, which is not part of the image.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/src/target \
    cargo build --release -p tinyflow-cli --locked \
    && install -D -m 0755 target/release/tinyflow /out/tinyflow

FROM debian:${DEBIAN_RELEASE}-slim
# ca-certificates: the system's CAs, which librdkafka (ssl.ca.location and
# https.ca.location unset), the schema registry client and S3 trust.
# zlib1g is in every Debian image already; it is named because the binary
# links it.
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates zlib1g \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 tinyflow \
    && useradd --uid 10001 --gid 10001 --no-create-home \
        --home-dir /var/lib/tinyflow --shell /usr/sbin/nologin tinyflow \
    && install -d -o 10001 -g 10001 -m 0750 /var/lib/tinyflow
COPY --from=builder /out/tinyflow /usr/local/bin/tinyflow
LABEL org.opencontainers.image.title="tinyflow" \
      org.opencontainers.image.description="Exactly-once Kafka to Apache Iceberg stream processor" \
      org.opencontainers.image.licenses="Apache-2.0"
# A numeric user, so that Kubernetes' runAsNonRoot can check it.
USER 10001:10001
WORKDIR /var/lib/tinyflow
# The metrics address of the example job (`[metrics] address`): /metrics,
# /healthz and /readyz.
EXPOSE 9898
# tinyflow is PID 1 and handles SIGTERM itself: a final checkpoint and
# commit, then exit 0.
ENTRYPOINT ["tinyflow"]
CMD ["run", "/etc/tinyflow/job.toml"]
