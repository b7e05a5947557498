# The two commands of the README. Everything else is plain CMake (see README "Building by hand").
BUILD ?= build
JOBS ?= 2
CMAKE_FLAGS ?=

.PHONY: run test deps build clean

run: build
	$(BUILD)/trainscope run

test: build
	cd $(BUILD) && ctest --output-on-failure -j1

deps:
	scripts/install-deps.sh

build: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)
	cmake --build $(BUILD) -j$(JOBS)

clean:
	rm -rf $(BUILD)
