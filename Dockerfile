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
USER 0
# The manifests mount emptyDirs here and at /tmp (the root filesystem is read-only there);
# under plain `docker run` the directory must still exist and belong to the ray user.
RUN mkdir -p /cache && chown 1000:100 /cache
USER 1000:100
COPY --from=build --chown=1000:100 /tmp/dist/eft-${EFT_VERSION}-py3-none-any.whl /tmp/
RUN pip install --no-cache-dir "/tmp/eft-${EFT_VERSION}-py3-none-any.whl" \
    && rm "/tmp/eft-${EFT_VERSION}-py3-none-any.whl"
ENV RAY_USAGE_STATS_ENABLED=0 \
    XDG_CACHE_HOME=/cache \
    HF_HOME=/cache/huggingface
WORKDIR /home/ray
