# edgeroute: `make demo` replays the quickstart scenario, `make test` runs the suite.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
RUN    := $(VENV)/.installed-run
# the suite's worker processes (pytest-xdist, a test file to a worker): most tests wait on processes,
# sockets and timers, so three share two cores well
TEST_WORKERS ?= 3
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

.PHONY: help venv demo test unit integration fuzz lint bench profile clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

# what the demo runs (edgeroute with its node and stack extras), and on top of it the test and lint tools
$(RUN): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[all]'
	touch $(RUN)

$(STAMP): $(RUN)
	$(PY) -m pip install --quiet -e '.[all,test]'
	touch $(STAMP)

venv: $(STAMP)  ## create .venv and install edgeroute with its test tools

demo: $(RUN)  ## start the embedded stack, replay scenarios/quickstart.yaml with round_robin and p2c, print the report
	$(VENV)/bin/edgeroute replay scenarios/quickstart.yaml --policy round_robin --policy p2c

test: $(STAMP)  ## run unit and integration tests (the Kafka ones again on kafka-python, the fallback client)
	$(PYTEST) tests
	EDGEROUTE_KAFKA_CLIENT=kafka-python $(PYTEST) tests/unit/test_kafka_wire.py \
		tests/integration/test_kafka_reader.py tests/integration/test_telemetry_flow.py \
		tests/integration/test_broker_outage.py

unit: $(STAMP)  ## run the unit tests only (no sockets)
	$(PYTEST) tests/unit

integration: $(STAMP)  ## run the integration tests only (real broker, nodes, router on loopback)
	$(PYTEST) tests/integration

fuzz: $(STAMP)  ## 10,000 generated hostile requests over HTTP, gRPC and MQTT against a live router and nodes, honest clients alongside
	EDGEROUTE_FUZZ_EXAMPLES=10000 EDGEROUTE_FUZZ_RANDOM=1 $(PY) -m pytest -q -s tests/integration/test_fuzz.py \
		tests/integration/test_grpc.py tests/integration/test_mqtt_fuzz.py -k "fuzz or hostile_publishes"

lint: $(STAMP)  ## ruff and mypy
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

bench: $(RUN)  ## router overhead, decision cost and simulator speed benchmarks (print, and write reports/bench/*.json)
	$(VENV)/bin/edgeroute bench router
	$(VENV)/bin/edgeroute bench decide
	$(VENV)/bin/edgeroute bench sim

profile: $(RUN)  ## re-measure the simulator profile of this machine (scenarios/profiles/cpu.json)
	$(VENV)/bin/edgeroute profile --out scenarios/profiles/cpu.json

clean:  ## remove the virtual environment and generated files
	rm -rf $(VENV) reports .pytest_cache .mypy_cache .ruff_cache *.egg-info
