#!/usr/bin/env bash
# Download, on a machine with network access, the wheels the test suite needs on the GPU image (Python 3.12, JAX
# 0.11.2, CUDA torch, no network): transformers 5.24.0 (the parity reference), the server (starlette, uvicorn, the
# grammar engine llguidance), the OpenAI client the server tests drive and jsonschema / regex the structured-output
# tests check with, with the dependencies the image lacks or has too old. Into .whl/.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    transformers==5.24.0 starlette==1.10.0 uvicorn==0.54.0 openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 \
    truststore==0.10.5 jiter==0.19.0 pydantic==2.14.4 pydantic_core==2.50.5 typing_inspection==0.4.5 \
    annotated_types==0.8.0 typing_extensions==4.16.0 anyio==4.16.0 idna==3.20 sniffio==1.3.1 \
    llguidance==1.9.1 jsonschema==4.26.0 jsonschema_specifications==2025.9.1 referencing==0.37.0 \
    rpds_py==2026.9.1 attrs==26.1.0 regex==2026.12.2
du -sh .whl
