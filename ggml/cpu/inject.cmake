# Puts deltaspec's CPU ops (the rows recurrence and conv of ggml/deltaspec_rows.h:
# deltaspec_rows_cpu.cpp, deltaspec_rows_conv_cpu.cpp; the tq KV cache nodes of ggml/deltaspec_tq.h:
# deltaspec_tq_cpu.cpp; the logits rows' top candidates of ggml/deltaspec_top.h: deltaspec_top_cpu.cpp)
# into ggml's ggml-cpu target, built with its flags and vector helpers, and compiles ggml-cpu.c with
# its gated_delta_net, ssm_conv, set_rows, flash_attn_ext and top_k entries renamed
# to our dispatchers, which run our nodes and hand every other node to ggml's own function. No
# upstream file is changed.
#
# Our build includes this file and calls deltaspec_add_cpu_ops() after add_subdirectory(ggml);
# ggml/cuda/inject.cmake does the same for a llama.cpp build that carries our CUDA kernels.
set(DELTASPEC_CPU_DIR "${CMAKE_CURRENT_LIST_DIR}")

function(deltaspec_add_cpu_ops)
    if(NOT TARGET ggml-cpu)
        return()
    endif()
    get_target_property(cpu_src_dir ggml-cpu SOURCE_DIR)
    target_sources(ggml-cpu PRIVATE "${DELTASPEC_CPU_DIR}/deltaspec_rows_cpu.cpp"
                                    "${DELTASPEC_CPU_DIR}/deltaspec_rows_conv_cpu.cpp"
                                    "${DELTASPEC_CPU_DIR}/deltaspec_tq_cpu.cpp"
                                    "${DELTASPEC_CPU_DIR}/deltaspec_top_cpu.cpp")
    # the tq quantizer must round as the CUDA one does: no fused multiply-adds but its explicit ones
    set_property(SOURCE "${DELTASPEC_CPU_DIR}/deltaspec_tq_cpu.cpp" TARGET_DIRECTORY ggml-cpu APPEND PROPERTY
        COMPILE_OPTIONS -ffp-contract=off)
    target_include_directories(ggml-cpu PRIVATE "${cpu_src_dir}/ggml-cpu" "${DELTASPEC_CPU_DIR}/..")
    set_property(SOURCE "${cpu_src_dir}/ggml-cpu/ggml-cpu.c" TARGET_DIRECTORY ggml-cpu APPEND PROPERTY
        COMPILE_DEFINITIONS ggml_compute_forward_gated_delta_net=deltaspec_cpu_gated_delta_net
                            ggml_compute_forward_ssm_conv=deltaspec_cpu_ssm_conv
                            ggml_compute_forward_set_rows=deltaspec_cpu_set_rows
                            ggml_compute_forward_flash_attn_ext=deltaspec_cpu_flash_attn_ext
                            ggml_compute_forward_top_k=deltaspec_cpu_top_k)
    message(STATUS "deltaspec: CPU rows ops and tq KV cache nodes added to ggml-cpu")
endfunction()
