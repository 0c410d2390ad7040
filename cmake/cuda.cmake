# The CUDA backend, by ANVIL_CUDA: AUTO builds it where nvcc is found, ON
# requires it, OFF leaves the CPU build untouched. Sets ANVIL_WITH_CUDA.
#
# Code for the GPUs Anvil targets: SASS for sm_80 (A100) and sm_90a (H100/H200,
# with the Hopper-only instructions: wgmma, TMA) plus compute_80 PTX, which the
# driver compiles for any newer GPU. The CUDA runtime is linked statically, so
# the binary needs no libcudart; cuBLAS and cuBLASLt are shared libraries,
# loaded from wherever CUDA 13's libraries are installed; cuDNN, below.
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
# cuDNN 9.14 and cuDNN's frontend (header-only C++) from PyPI's wheels, which
# scripts/setup.sh installs into .venv where nvcc is found: the GPU machine
# Anvil is checked on has cuDNN 9.14, and cuDNN does not promise to run with
# an older minor version than the one built against, so the build takes 9.14
# whatever cuDNN the toolkit here carries (CUDA 13.0's folder has 9.19).
# Searched anew at each configure (NO_CACHE, and any cache entry of the same
# name, which would stop the search, dropped first), so a build folder
# configured before keeps no path to another cuDNN.
#
# The binary loads libcudnn.so.9 as a shared library (libcudnn.so.9 dlopens
# its engines beside itself, by its RUNPATH $ORIGIN). In the build tree the
# binary's RUNPATH names the wheel's lib folder, so here it loads 9.14.
# bench/gpu/pack.sh packs no cuDNN: on the GPU machine that folder does not
# exist and the loader finds the machine's own cuDNN 9.14; `anvil info` says
# which version was loaded and warns when it is older than the one built
# against (cuda/device.h).
file(GLOB ANVIL_VENV_SITE_PACKAGES ${CMAKE_SOURCE_DIR}/.venv/lib/python3*/site-packages)
string(CONCAT ANVIL_CUDNN_SETUP "run scripts/setup.sh, which installs nvidia-cudnn-cu13==9.14.0.64 and "
              "nvidia-cudnn-frontend==1.15.0 into .venv where nvcc is found")
unset(ANVIL_CUDNN_INCLUDE_DIR CACHE)
unset(ANVIL_CUDNN_LIBRARY CACHE)
unset(ANVIL_CUDNN_FRONTEND_INCLUDE_DIR CACHE)
find_path(ANVIL_CUDNN_INCLUDE_DIR cudnn_version.h PATHS ${ANVIL_VENV_SITE_PACKAGES} PATH_SUFFIXES nvidia/cudnn/include
          NO_DEFAULT_PATH NO_CACHE)
find_library(ANVIL_CUDNN_LIBRARY NAMES libcudnn.so.9 PATHS ${ANVIL_VENV_SITE_PACKAGES} PATH_SUFFIXES nvidia/cudnn/lib
             NO_DEFAULT_PATH NO_CACHE)
find_path(ANVIL_CUDNN_FRONTEND_INCLUDE_DIR cudnn_frontend.h PATHS ${ANVIL_VENV_SITE_PACKAGES} PATH_SUFFIXES include
          NO_DEFAULT_PATH NO_CACHE)
if(NOT ANVIL_CUDNN_INCLUDE_DIR OR NOT ANVIL_CUDNN_LIBRARY OR NOT ANVIL_CUDNN_FRONTEND_INCLUDE_DIR)
  if(ANVIL_CUDA STREQUAL "ON")
    message(FATAL_ERROR "ANVIL_CUDA=ON but cuDNN 9.14 and cuDNN's frontend are not in ${CMAKE_SOURCE_DIR}/.venv: "
                        "${ANVIL_CUDNN_SETUP}, or configure with -DANVIL_CUDA=OFF")
  endif()
  message(STATUS "anvil: CUDA backend off (no cuDNN 9.14 in .venv; ANVIL_CUDA=AUTO): ${ANVIL_CUDNN_SETUP}")
  return()
endif()
file(STRINGS ${ANVIL_CUDNN_INCLUDE_DIR}/cudnn_version.h ANVIL_CUDNN_VERSION_LINES
     REGEX "^#define CUDNN_(MAJOR|MINOR|PATCHLEVEL) [0-9]+")
string(REGEX REPLACE ".*CUDNN_MAJOR ([0-9]+).*CUDNN_MINOR ([0-9]+).*CUDNN_PATCHLEVEL ([0-9]+).*" "\\1.\\2.\\3"
                     ANVIL_CUDNN_VERSION "${ANVIL_CUDNN_VERSION_LINES}")
if(NOT ANVIL_CUDNN_VERSION MATCHES "^9\\.14\\.")
  message(FATAL_ERROR "the CUDA backend builds against cuDNN 9.14, but ${ANVIL_CUDNN_INCLUDE_DIR} has cuDNN "
                      "${ANVIL_CUDNN_VERSION}: ${ANVIL_CUDNN_SETUP}")
endif()

set(ANVIL_WITH_CUDA ON)
message(STATUS "anvil: CUDA backend on (CUDA ${CUDAToolkit_VERSION}, cuDNN ${ANVIL_CUDNN_VERSION} "
               "${ANVIL_CUDNN_LIBRARY}, cuDNN frontend ${ANVIL_CUDNN_FRONTEND_INCLUDE_DIR}; "
               "SASS sm_80 sm_90a, PTX compute_80)")
