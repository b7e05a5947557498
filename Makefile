# The two commands of the README. Everything else is plain CMake (see docs/development.md).
BUILD ?= build
JOBS ?= 2
CMAKE_FLAGS ?=
# The virtual environment with the pinned torch wheel (scripts/install-deps.sh makes it).
TORCH_VENV := $(shell scripts/torch-venv.sh)

.PHONY: run test test-unit deps configure build build-tests clean

run: build
	$(BUILD)/trainscope run

# Two at a time: the unit tests are mostly a process's start (loading LibTorch); every test that runs
# ranks or times a run is RUN_SERIAL (tests/CMakeLists.txt), so it runs alone.
test: build-tests
	cd $(BUILD) && ctest --output-on-failure -j$(JOBS)

# The inner loop: the pieces alone (ctest label unit: a few minutes, docs/development.md#tests).
test-unit: build-tests
	cd $(BUILD) && ctest --output-on-failure -j$(JOBS) -L unit

deps:
	scripts/install-deps.sh

configure: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release -DTRAINSCOPE_TORCH_VENV=$(TORCH_VENV) $(CMAKE_FLAGS)

build: configure
	cmake --build $(BUILD) -j$(JOBS)

# The binary and the tests, without the benchmarks.
build-tests: configure
	cmake --build $(BUILD) -j$(JOBS) --target trainscope_tests

clean:
	rm -rf $(BUILD)
