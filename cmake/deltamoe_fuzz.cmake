# libFuzzer targets (DELTAMOE_FUZZ=ON, clang only): tests/fuzz/<name>_fuzz.cc -> fuzz_<name>, with
# its seed corpus in tests/fuzz/<name>/. `fuzz_targets` builds them all; scripts/fuzz.sh runs them.
# The libraries they use are compiled with coverage instrumentation and ASan + UBSan (see the
# DELTAMOE_FUZZ block of CMakeLists.txt); the system image codecs are not instrumented.

add_custom_target(fuzz_targets)

function(deltamoe_fuzz_target NAME)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS" ${ARGN})
  add_executable(fuzz_${NAME} ${PROJECT_SOURCE_DIR}/tests/fuzz/${NAME}_fuzz.cc ${ARG_SOURCES})
  target_include_directories(fuzz_${NAME} PRIVATE ${PROJECT_SOURCE_DIR}/src)
  target_link_libraries(fuzz_${NAME} PRIVATE ${ARG_DEPS})
  target_link_options(fuzz_${NAME} PRIVATE -fsanitize=fuzzer)
  add_dependencies(fuzz_targets fuzz_${NAME})
endfunction()

deltamoe_fuzz_target(sft_record DEPS deltamoe_data)
deltamoe_fuzz_target(image_decode DEPS deltamoe_data)
# The safetensors reader alone (linking deltamoe_checkpoint would build the model and kernels too).
deltamoe_fuzz_target(safetensors
  SOURCES ${PROJECT_SOURCE_DIR}/src/checkpoint/safetensors.cc ${PROJECT_SOURCE_DIR}/src/checkpoint/stored_tensor.cc
          ${PROJECT_SOURCE_DIR}/src/checkpoint/finite_check.cc
  DEPS deltamoe_core nlohmann_json::nlohmann_json)
