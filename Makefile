# Two entry points (README): `make demo` builds the demo bundle if missing and serves it;
# `make test` installs everything the tests need and runs them.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test install lint bench-latency clean image image-cuda lint-docker container-test load docs-test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch is pinned to the CPU build that installs locally (a looser pin pulls gigabytes of CUDA).
# constraints.txt: the same pinned versions the images install. The ray extra: tests/test_ray_serve.py.
install: $(BIN)/python
	$(BIN)/pip install -q -c constraints.txt -e '.[train,dev,ray]'

demo: install
	$(BIN)/shortlist demo --workdir .demo

test: install
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

bench-latency: install
	$(BIN)/python bench/latency.py

# The serving images (docker/build.sh: starts a Docker engine and makes a local base image when
# none is reachable, then builds). The CUDA image is multi-gigabyte: its own target.
image:
	docker/build.sh cpu

image-cuda:
	docker/build.sh cuda

lint-docker: install
	$(BIN)/hadolint --failure-threshold error docker/Dockerfile docker/Dockerfile.cuda

# The CPU image end to end on a real engine (tests_container/); CI runs it after `make test`.
container-test: install lint-docker image
	$(BIN)/python -m pytest tests_container/test_container.py -q -p no:cacheprovider

# /docs of the running container with every host but loopback blocked, in headless Chromium
# (Debian's chromium and chromium-driver, installed here when missing): a prediction through the page.
docs-test: install image
	command -v chromedriver >/dev/null || (apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium chromium-driver)
	$(BIN)/pip install -q -c constraints.txt -e '.[browser]'
	$(BIN)/python -m pytest tests_container/test_docs_offline.py -q -p no:cacheprovider

# A locust step ramp against URL (any deployed instance), or, without URL, against the container
# on BUNDLE (default: the demo's bundle, built if missing) and beside it `shortlist serve` on the
# same bundle; reports in bench/out/load/, the summary in bench/RESULTS.md.
load:
	$(BIN)/pip install -q -c constraints.txt -e '.[load]'
	$(BIN)/python bench/load/run.py $(if $(URL),--url $(URL),$(if $(BUNDLE),--bundle $(BUNDLE)) --compare-bare) --publish

clean:
	rm -rf .demo .pytest_cache
