# The kernel instantiations of the CUDA backend, generated from one list.
#
# Every template src/cuda/sm80/<family>.inst.cu.in (fwd, bwd, ...) is expanded once per
# head-dim bucket in FLASHATTN_HEAD_DIMS and dtype in FLASHATTN_CUDA_DTYPES into
#   <build>/src/cuda/generated/<family>_hdim<D>_<dtype>.cu
# with @HEAD_DIM@, @DTYPE@ (fp16 | bf16) and @ELEMENT@ (__half | __nv_bfloat16) substituted.
# A template holds exactly one explicit instantiation, so every generated translation unit
# compiles one kernel (per arch) and the full build parallelises across them. Features that
# keep the tile shapes (masks, softcap, ALiBi, dropout, varlen, KV cache) are run-time
# branches inside that kernel, never further instantiations.
#
# The generated header flashattn_cuda_manifest.hpp hands the same list to the dispatch:
#   FLASHATTN_CUDA_FOR_EACH_HEAD_DIM(X)   expands to X(32) X(64) ... (compiled buckets, ascending)
#   FLASHATTN_CUDA_FOR_EACH_DTYPE(X)      expands to X(fp16, __half) X(bf16, __nv_bfloat16)

set(FLASHATTN_CUDA_BUCKETS 32 64 96 128 160 192 224 256)
set(FLASHATTN_CUDA_DTYPES fp16 bf16)
set(FLASHATTN_CUDA_ELEMENT_fp16 __half)
set(FLASHATTN_CUDA_ELEMENT_bf16 __nv_bfloat16)

function(flashattn_cuda_manifest out_sources out_include_dir)
  set(head_dims ${FLASHATTN_HEAD_DIMS})
  list(SORT head_dims COMPARE NATURAL)
  list(REMOVE_DUPLICATES head_dims)
  foreach(d ${head_dims})
    if(NOT d IN_LIST FLASHATTN_CUDA_BUCKETS)
      message(FATAL_ERROR "FLASHATTN_HEAD_DIMS: ${d} is not a bucket (${FLASHATTN_CUDA_BUCKETS})")
    endif()
  endforeach()

  set(gen_dir ${CMAKE_CURRENT_BINARY_DIR}/generated)
  file(MAKE_DIRECTORY ${gen_dir})
  file(GLOB templates CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/sm80/*.inst.cu.in)
  set(sources)
  foreach(template ${templates})
    get_filename_component(name ${template} NAME)
    string(REGEX REPLACE "\\.inst\\.cu\\.in$" "" family ${name})
    foreach(d ${head_dims})
      foreach(dtype ${FLASHATTN_CUDA_DTYPES})
        set(HEAD_DIM ${d})
        set(DTYPE ${dtype})
        set(ELEMENT ${FLASHATTN_CUDA_ELEMENT_${dtype}})
        set(out ${gen_dir}/${family}_hdim${d}_${dtype}.cu)
        configure_file(${template} ${out} @ONLY)
        list(APPEND sources ${out})
      endforeach()
    endforeach()
  endforeach()

  set(head_dim_list "")
  foreach(d ${head_dims})
    string(APPEND head_dim_list " X(${d})")
  endforeach()
  set(dtype_list "")
  foreach(dtype ${FLASHATTN_CUDA_DTYPES})
    string(APPEND dtype_list " X(${dtype}, ${FLASHATTN_CUDA_ELEMENT_${dtype}})")
  endforeach()
  file(CONFIGURE OUTPUT ${gen_dir}/flashattn_cuda_manifest.hpp CONTENT
"// Generated from src/cuda/manifest.cmake: the compiled kernel instantiations.
#pragma once
#define FLASHATTN_CUDA_FOR_EACH_HEAD_DIM(X)${head_dim_list}
#define FLASHATTN_CUDA_FOR_EACH_DTYPE(X)${dtype_list}
" @ONLY)
  set(${out_sources} ${sources} PARENT_SCOPE)
  set(${out_include_dir} ${gen_dir} PARENT_SCOPE)
endfunction()
