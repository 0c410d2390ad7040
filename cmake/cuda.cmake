# The CUDA backend, by ANVIL_CUDA: AUTO builds it where nvcc is found, ON
# requires it, OFF leaves the CPU build untouched. Sets ANVIL_WITH_CUDA.
#
# Code for the GPUs Anvil targets: SASS for sm_80 (A100) and sm_90a (H100/H200,
# with the Hopper-only instructions: wgmma, TMA) plus compute_80 PTX, which the
# driver compiles for any newer GPU. The CUDA runtime is linked statically, so
# the binary needs no libcudart; cuBLAS, cuBLASLt and cuDNN are shared
# libraries, loaded from wherever CUDA 13's libraries are installed.
string(TOUPPER "${ANVIL_CUDA}" ANVIL_CUDA)
if(NOT ANVIL_CUDA MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "ANVIL_CUDA must be AUTO, ON or OFF, not '${ANVIL_CUDA}'")
endif()
set(ANVIL_WITH_CUDA OFF)
if(ANVIL_CUDA STREQUAL "OFF")
  return()
endif()
include(CheckLanguage)
check_language(CUDA)
if(NOT CMAKE_CUDA_COMPILER)
  if(ANVIL_CUDA STREQUAL "ON")
    message(FATAL_ERROR "ANVIL_CUDA=ON but no CUDA compiler was found: put nvcc on PATH (for example "
                        "/usr/local/cuda/bin) or set CMAKE_CUDA_COMPILER, or configure with -DANVIL_CUDA=OFF")
  endif()
  message(STATUS "anvil: CUDA backend off (no nvcc found; ANVIL_CUDA=AUTO)")
  return()
endif()

set(CMAKE_CUDA_ARCHITECTURES 80-real 90a-real 80-virtual)
set(CMAKE_CUDA_RUNTIME_LIBRARY Static)
enable_language(CUDA)
# C++20 as in the CPU code (CUDA files take the CXX_STANDARD). CMake 3.25 knows
# nvcc's flags only up to C++17, so it is told nvcc 13's flag for C++20.
set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION -std=c++20)
set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION -std=c++20)
set(CMAKE_CUDA_STANDARD 20)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)
find_package(CUDAToolkit REQUIRED)
if(CUDAToolkit_VERSION_MAJOR LESS 13)
  message(FATAL_ERROR "the CUDA backend needs CUDA 13 (found ${CUDAToolkit_VERSION}); configure with -DANVIL_CUDA=OFF "
                      "to build for the CPU only")
endif()

# CUDA 13 keeps Thrust, CUB and libcu++ (CCCL) under include/cccl; CMake 3.25
# does not add that folder to the include path by itself.
find_path(ANVIL_CCCL_INCLUDE_DIR cuda/std/version PATHS ${CUDAToolkit_INCLUDE_DIRS} PATH_SUFFIXES cccl
          NO_DEFAULT_PATH REQUIRED)
# cuDNN 9 sits beside the toolkit or in the system's library folders.
find_path(ANVIL_CUDNN_INCLUDE_DIR cudnn.h HINTS ${CUDAToolkit_INCLUDE_DIRS} REQUIRED)
find_library(ANVIL_CUDNN_LIBRARY cudnn HINTS ${CUDAToolkit_LIBRARY_DIR} REQUIRED)

set(ANVIL_WITH_CUDA ON)
message(STATUS "anvil: CUDA backend on (CUDA ${CUDAToolkit_VERSION}, cuDNN ${ANVIL_CUDNN_LIBRARY}; "
               "SASS sm_80 sm_90a, PTX compute_80)")
