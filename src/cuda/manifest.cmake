# The manifest of the CUDA backend: every kernel family, its compiled instantiations and
# the architectures it is built for. Nothing else lists them: the dispatch reads the
# generated header below, the tests the same header through the library.
#
#   family  templates             head-dim buckets        code generated
#   sm80    sm80/*.inst.cu.in     FLASHATTN_CUDA_BUCKETS  for each arch in FLASHATTN_CUDA_ARCHS:
#           (fwd, bwd and decode  (and WIDE_BUCKETS)
#           also WIDE_BUCKETS)
#                                                         its SASS and its PTX (the compute_80
#                                                         and compute_90 PTX run GPUs newer
#                                                         than the SASS: sm100, sm120, ...)
#   sm90    sm90/*.inst.cu.in     FLASHATTN_CUDA_SM90_    sm_90a SASS only (wgmma, setmaxnreg:
#           and sm90/*.cu         BUCKETS                 no PTX can carry them forward); built
#                                                         only when 90 is in FLASHATTN_CUDA_ARCHS
#
# Every template <family>/<kernel>.inst.cu.in (fwd, bwd, decode, ...) is expanded once per
# head-dim bucket of its family in FLASHATTN_HEAD_DIMS and per dtype in
# FLASHATTN_CUDA_DTYPES into <build>/src/cuda/generated/<family>_<kernel>_hdim<D>_<dtype>.cu
# with @HEAD_DIM@, @DTYPE@ (fp16 | bf16) and @ELEMENT@ (__half | __nv_bfloat16)
# substituted. A template holds one explicit instantiation (its configurations: the
# bucket's tiles for each shared-memory size, tile_size.hpp), so every generated
# translation unit compiles one kernel entry and the build parallelises across them.
# Features that keep the tile shapes (masks, softcap, ALiBi, dropout, varlen, KV cache)
# are run-time branches inside a kernel, never further instantiations.
#
# FLASHATTN_CUDA_WIDE_BUCKETS are expanded for the sm80 templates in
# FLASHATTN_CUDA_WIDE_KERNELS alone (the forward, the backward and the KV-cache decode
# kernel): head dims that only they run (512: d or d_v in 264 .. 512; the forward splits V
# and O into 256-column slices over the grid, sm80/tile_size.hpp's fwd_v_cols; the backward
# runs 32-key tiles, sm80/bwd_config.cuh's kWide; the decode kernel's warps split O's
# columns over 16-key tiles, sm80/decode_launch.hpp's kColGroups; no MLA or sm90 kernel).
#
# The generated header flashattn_cuda_manifest.hpp hands the lists to the dispatch:
#   FLASHATTN_CUDA_FOR_EACH_HEAD_DIM(X)       X(32) X(64) ...  (sm80 buckets of every kernel
#                                             compiled, ascending)
#   FLASHATTN_CUDA_FOR_EACH_WIDE_HEAD_DIM(X)  X(512) when compiled (the forward's, the
#                                             backward's and the decode kernel's)
#   FLASHATTN_CUDA_SM90_FOR_EACH_HEAD_DIM(X)  the same for sm90 (empty when not built)
#   FLASHATTN_CUDA_FOR_EACH_DTYPE(X)          X(fp16, __half) X(bf16, __nv_bfloat16)

set(FLASHATTN_CUDA_BUCKETS 32 64 96 128 160 192 224 256)
set(FLASHATTN_CUDA_WIDE_BUCKETS 512)
set(FLASHATTN_CUDA_WIDE_KERNELS fwd bwd decode)
set(FLASHATTN_CUDA_SM90_BUCKETS 32 64 96 128 160 192 224 256)
set(FLASHATTN_CUDA_SM90_GENCODE -gencode=arch=compute_90a,code=sm_90a)
set(FLASHATTN_CUDA_DTYPES fp16 bf16)
set(FLASHATTN_CUDA_ELEMENT_fp16 __half)
set(FLASHATTN_CUDA_ELEMENT_bf16 __nv_bfloat16)

# Expands the templates of one family folder over `buckets` x dtypes into out_sources.
function(flashattn_cuda_expand family buckets gen_dir out_sources)
  file(GLOB templates CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/${family}/*.inst.cu.in)
  set(sources)
  foreach(template ${templates})
    get_filename_component(name ${template} NAME)
    string(REGEX REPLACE "\\.inst\\.cu\\.in$" "" kernel ${name})
    foreach(d ${buckets})
      if(d IN_LIST FLASHATTN_CUDA_WIDE_BUCKETS AND NOT kernel IN_LIST FLASHATTN_CUDA_WIDE_KERNELS)
        continue()
      endif()
      foreach(dtype ${FLASHATTN_CUDA_DTYPES})
        set(HEAD_DIM ${d})
        set(DTYPE ${dtype})
        set(ELEMENT ${FLASHATTN_CUDA_ELEMENT_${dtype}})
        set(out ${gen_dir}/${family}_${kernel}_hdim${d}_${dtype}.cu)
        configure_file(${template} ${out} @ONLY)
        list(APPEND sources ${out})
      endforeach()
    endforeach()
  endforeach()
  set(${out_sources} ${sources} PARENT_SCOPE)
endfunction()

function(flashattn_x_list out)
  set(list "")
  foreach(d ${ARGN})
    string(APPEND list " X(${d})")
  endforeach()
  set(${out} "${list}" PARENT_SCOPE)
endfunction()

# out_sm80 / out_sm90: the generated translation units of each family (sm90: empty unless
# built); out_with_sm90: whether the sm90 family is built; out_include_dir: the header's.
function(flashattn_cuda_manifest out_sm80 out_sm90 out_with_sm90 out_include_dir)
  set(head_dims ${FLASHATTN_HEAD_DIMS})
  list(SORT head_dims COMPARE NATURAL)
  list(REMOVE_DUPLICATES head_dims)
  set(all_dims)
  set(wide_dims)
  foreach(d ${head_dims})
    if(d IN_LIST FLASHATTN_CUDA_WIDE_BUCKETS)
      list(APPEND wide_dims ${d})
    elseif(d IN_LIST FLASHATTN_CUDA_BUCKETS)
      list(APPEND all_dims ${d})
    else()
      message(FATAL_ERROR "FLASHATTN_HEAD_DIMS: ${d} is not a bucket "
                          "(${FLASHATTN_CUDA_BUCKETS} ${FLASHATTN_CUDA_WIDE_BUCKETS})")
    endif()
  endforeach()
  set(with_sm90 OFF)
  if("90" IN_LIST FLASHATTN_CUDA_ARCHS OR "90-real" IN_LIST FLASHATTN_CUDA_ARCHS)
    set(with_sm90 ON)
  endif()
  set(sm90_dims)
  if(with_sm90)
    foreach(d ${head_dims})
      if(d IN_LIST FLASHATTN_CUDA_SM90_BUCKETS)
        list(APPEND sm90_dims ${d})
      endif()
    endforeach()
  endif()

  set(gen_dir ${CMAKE_CURRENT_BINARY_DIR}/generated)
  file(MAKE_DIRECTORY ${gen_dir})
  flashattn_cuda_expand(sm80 "${head_dims}" ${gen_dir} sm80_sources)
  flashattn_cuda_expand(sm90 "${sm90_dims}" ${gen_dir} sm90_sources)

  flashattn_x_list(head_dim_list ${all_dims})
  flashattn_x_list(wide_dim_list ${wide_dims})
  flashattn_x_list(sm90_dim_list ${sm90_dims})
  set(dtype_list "")
  foreach(dtype ${FLASHATTN_CUDA_DTYPES})
    string(APPEND dtype_list " X(${dtype}, ${FLASHATTN_CUDA_ELEMENT_${dtype}})")
  endforeach()
  file(CONFIGURE OUTPUT ${gen_dir}/flashattn_cuda_manifest.hpp CONTENT
"// Generated from src/cuda/manifest.cmake: the compiled kernel instantiations.
#pragma once
#define FLASHATTN_CUDA_FOR_EACH_HEAD_DIM(X)${head_dim_list}
#define FLASHATTN_CUDA_FOR_EACH_WIDE_HEAD_DIM(X)${wide_dim_list}
#define FLASHATTN_CUDA_SM90_FOR_EACH_HEAD_DIM(X)${sm90_dim_list}
#define FLASHATTN_CUDA_FOR_EACH_DTYPE(X)${dtype_list}
" @ONLY)
  set(${out_sm80} ${sm80_sources} PARENT_SCOPE)
  set(${out_sm90} ${sm90_sources} PARENT_SCOPE)
  set(${out_with_sm90} ${with_sm90} PARENT_SCOPE)
  set(${out_include_dir} ${gen_dir} PARENT_SCOPE)
endfunction()
