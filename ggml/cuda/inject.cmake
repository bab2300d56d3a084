# Puts deltaspec's CUDA kernels into ggml's ggml-cuda target: adds deltaspec_matmul.cu (and the
# batched state copies, deltaspec_copies.cu, and the verify batches' DeltaNet recurrence,
# deltaspec_deltanet.cu, and short-row concatenation, deltaspec_concat.cu, and the rows ops of
# ggml/deltaspec_rows.h, deltaspec_rows.cu, and the tq KV cache nodes of ggml/deltaspec_tq.h,
# deltaspec_tq.cu, and the logits rows' top candidates of ggml/deltaspec_top.h, deltaspec_top.cu,
# and the batch-invariant backends' registry and attention, deltaspec_invariant.cu)
# and compiles ggml-cuda.cu with its quantized mat-vec (and its F32/F16 mat-vec and that one's
# choice, for batch-invariant backends)
# and tile-kernel entries (and its fused rms_norm, swiglu and add, for the norms, SwiGLUs and
# residual adds folded into our kernels, and its gated_delta_net, ssm_conv and concat entries, and
# its set_rows and flash-attention entries with FA's support and allocation-size queries, and its
# top_k entry)
# renamed to our dispatchers, which compute what our kernels serve and hand the rest to ggml's own
# functions. No upstream file is changed.
#
# Our build includes this file and calls deltaspec_add_cuda_kernels() after add_subdirectory(ggml).
# A llama.cpp build gets it with -DCMAKE_PROJECT_INCLUDE=<this file>: the call is then deferred
# to the end of ggml's directory, where ggml-cuda exists. The kernels stay off until
# deltaspec_cuda_set_kernels(true), so llama.cpp itself runs ggml's kernels.
set(DELTASPEC_CUDA_DIR "${CMAKE_CURRENT_LIST_DIR}")

function(deltaspec_add_cuda_kernels)
    if(NOT TARGET ggml-cuda)
        return()
    endif()
    get_target_property(cuda_src_dir ggml-cuda SOURCE_DIR)
    target_sources(ggml-cuda PRIVATE "${DELTASPEC_CUDA_DIR}/deltaspec_matmul.cu"
                                     "${DELTASPEC_CUDA_DIR}/deltaspec_copies.cu"
                                     "${DELTASPEC_CUDA_DIR}/deltaspec_deltanet.cu"
                                     "${DELTASPEC_CUDA_DIR}/deltaspec_concat.cu"
                                     "${DELTASPEC_CUDA_DIR}/deltaspec_rows.cu"
                                     "${DELTASPEC_CUDA_DIR}/deltaspec_tq.cu"
                                     "${DELTASPEC_CUDA_DIR}/deltaspec_top.cu"
                                     "${DELTASPEC_CUDA_DIR}/deltaspec_invariant.cu")
    target_include_directories(ggml-cuda PRIVATE "${cuda_src_dir}" "${DELTASPEC_CUDA_DIR}" "${DELTASPEC_CUDA_DIR}/..")
    set(renamed
        ggml_cuda_mul_mat_vec_q=deltaspec_mul_mat_vec_q
        ggml_cuda_mul_mat_q=deltaspec_mul_mat_q
        ggml_cuda_mul_mat_vec_f=deltaspec_mul_mat_vec_f
        ggml_cuda_should_use_mmvf=deltaspec_should_use_mmvf
        ggml_cuda_op_rms_norm_fused=deltaspec_rms_norm_fused
        ggml_cuda_op_swiglu=deltaspec_op_swiglu
        ggml_cuda_op_add=deltaspec_op_add
        ggml_cuda_op_gated_delta_net=deltaspec_op_gated_delta_net
        ggml_cuda_op_gated_delta_net_fused_cache=deltaspec_op_gated_delta_net_fused_cache
        ggml_cuda_op_ssm_conv=deltaspec_op_ssm_conv
        ggml_cuda_op_concat=deltaspec_op_concat
        ggml_cuda_op_set_rows=deltaspec_tq_op_set_rows
        ggml_cuda_flash_attn_ext=deltaspec_tq_flash_attn_ext
        ggml_cuda_flash_attn_ext_supported=deltaspec_tq_flash_attn_ext_supported
        ggml_cuda_flash_attn_ext_get_alloc_size=deltaspec_tq_flash_attn_ext_get_alloc_size
        ggml_cuda_op_top_k=deltaspec_op_top_k)
    set_source_files_properties("${cuda_src_dir}/ggml-cuda.cu" TARGET_DIRECTORY ggml-cuda
        PROPERTIES COMPILE_DEFINITIONS "${renamed}")
    message(STATUS "deltaspec: CUDA kernels added to ggml-cuda")
endfunction()

if(PROJECT_NAME STREQUAL "ggml" AND NOT DELTASPEC_CUDA_KERNELS_DEFERRED)
    set(DELTASPEC_CUDA_KERNELS_DEFERRED ON)
    cmake_language(DEFER CALL deltaspec_add_cuda_kernels)
    # the rows ops' CPU side too: their nodes may run on either backend (ggml/deltaspec_rows.h)
    include("${CMAKE_CURRENT_LIST_DIR}/../cpu/inject.cmake")
    cmake_language(DEFER CALL deltaspec_add_cpu_ops)
endif()
