# Included by `make venv` right after llama.cpp's project() when pip builds
# llama-cpp-python (CMAKE_PROJECT_llama.cpp_INCLUDE): the Python bindings load
# libllama and libggml only, but llama-cpp-python forces llama.cpp's `common`
# library on, which is more than half of the compile (JSON, chat templates,
# argument parsing, an HTTP client) for nothing the bindings call.
set(LLAMA_BUILD_COMMON OFF CACHE BOOL "llama: build common utils library" FORCE)
