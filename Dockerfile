# The eft image the KubeRay manifests run (head, workers, the RayJob submitter) and that
# jobs/README.md pushes to a registry:
#
#   docker build -t YOUR-REGISTRY/eft:0.1.0-ray2.60.0-gpu .
#
# The base is Ray's own CUDA image at exactly the Ray version the manifests declare
# (rayVersion 2.60.0), with the Python the project is tested on. Pin it by digest in your fork
# once you have pulled it (`docker buildx imagetools inspect rayproject/ray:2.60.0-py311-gpu`).
# eft is built into a wheel from this checkout and installed at the version pyproject.toml
# declares (the COPY fails if the two disagree). Nothing secret goes into the image: S3 access
# comes from the pod's service account or a Secret at run time.

FROM rayproject/ray:2.60.0-py311-gpu AS build
COPY pyproject.toml /src/
COPY app /src/app
# setuptools writes into the tree it builds: build a copy the ray user owns.
RUN cp -r /src /tmp/build && pip wheel --no-cache-dir --no-deps --wheel-dir /tmp/dist /tmp/build

FROM rayproject/ray:2.60.0-py311-gpu
ARG EFT_VERSION=0.1.0
# NCCL reaches AWS EFA only through the aws-ofi-nccl plugin over libfabric's efa provider. AWS's
# EFA installer ships both, built against each other; 1.48.0 carries aws-ofi-nccl 1.19, which
# NCCL 2.19 and later load (torch's own NCCL is newer). User space only: the EFA kernel driver
# is the node's (EKS GPU AMIs, ParallelCluster). Optionally pin the download with
# --build-arg EFA_INSTALLER_SHA256=... (AWS publishes it beside the tarball).
ARG EFA_INSTALLER_VERSION=1.48.0
ARG EFA_INSTALLER_SHA256=""
USER 0
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# The manifests mount emptyDirs here and at /tmp (the root filesystem is read-only there);
# under plain `docker run` the directory must still exist and belong to the ray user.
RUN mkdir -p /cache && chown 1000:100 /cache
RUN python -c "import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])" \
        "https://efa-installer.amazonaws.com/aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz" /tmp/efa.tar.gz \
    && if [[ -n "${EFA_INSTALLER_SHA256}" ]]; then echo "${EFA_INSTALLER_SHA256}  /tmp/efa.tar.gz" | sha256sum -c -; fi \
    && tar -xzf /tmp/efa.tar.gz -C /tmp && rm /tmp/efa.tar.gz
WORKDIR /tmp/aws-efa-installer
# -g: the GPU build with the NCCL plugin; no kernel module, no host limits, no device check
# (the build machine has no EFA device).
RUN ./efa_installer.sh -y -g -d --skip-kmod --skip-limit-conf --no-verify \
    && rm -rf /tmp/aws-efa-installer /var/lib/apt/lists/* \
    && /opt/amazon/efa/bin/fi_info --version
# The plugin and libfabric where NCCL's dlopen finds them; fi_info on PATH for checking a node.
ENV LD_LIBRARY_PATH=/opt/amazon/ofi-nccl/lib:/opt/amazon/efa/lib:${LD_LIBRARY_PATH} \
    PATH=/opt/amazon/efa/bin:${PATH}
USER 1000:100
COPY --from=build --chown=1000:100 /tmp/dist/eft-${EFT_VERSION}-py3-none-any.whl /tmp/
RUN pip install --no-cache-dir "/tmp/eft-${EFT_VERSION}-py3-none-any.whl" \
    && rm "/tmp/eft-${EFT_VERSION}-py3-none-any.whl"
ENV RAY_USAGE_STATS_ENABLED=0 \
    XDG_CACHE_HOME=/cache \
    HF_HOME=/cache/huggingface
WORKDIR /home/ray
