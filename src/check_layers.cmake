# The layering of docs/ARCHITECTURE.md, checked on every build: a source file
# of a layer may include only the layers listed for it. Run by the build
# (src/CMakeLists.txt) as `cmake -DSRC=<src> -P check_layers.cmake`; an include
# against the layering stops the build, naming the file, the line and what the
# layer may include.
cmake_minimum_required(VERSION 3.20)
set(allowed_core core)
set(allowed_cuda core cuda)
set(allowed_ops core cuda ops)  # cuda: for the CUDA twins (ops/cuda/), built only with the backend
set(allowed_model core ops model)
set(allowed_data core data)
set(allowed_distributed core ops model distributed)
set(allowed_pipeline core ops model distributed pipeline)
set(allowed_estimate core ops model pipeline estimate)
set(allowed_obs core estimate obs)
set(allowed_train core ops model data distributed pipeline estimate obs train)
set(allowed_generate core ops model generate)
set(allowed_cli core cuda ops model data distributed pipeline estimate obs train generate cli)
set(layers core cuda ops model data distributed pipeline estimate obs train generate cli)

file(GLOB dirs RELATIVE ${SRC}/anvil ${SRC}/anvil/*)
foreach(dir ${dirs})
  if(IS_DIRECTORY ${SRC}/anvil/${dir} AND NOT dir IN_LIST layers)
    message(FATAL_ERROR "src/anvil/${dir}/ is not a layer of check_layers.cmake: add it, with what it may include")
  endif()
endforeach()
foreach(layer ${layers})
  # A layer's CUDA twins (ops/cuda/*.cu) keep the layer's rules.
  file(GLOB files ${SRC}/anvil/${layer}/*.h ${SRC}/anvil/${layer}/*.cpp ${SRC}/anvil/${layer}/*.cu
                  ${SRC}/anvil/${layer}/cuda/*.h ${SRC}/anvil/${layer}/cuda/*.cu)
  foreach(f ${files})
    file(STRINGS ${f} includes REGEX "^#include \"anvil/")
    foreach(line ${includes})
      string(REGEX REPLACE "^#include \"anvil/([a-z_]+)/.*" "\\1" dep "${line}")
      if(NOT dep IN_LIST allowed_${layer})
        file(RELATIVE_PATH rel ${SRC} ${f})
        message(FATAL_ERROR "${rel}: ${line} crosses the layering: src/anvil/${layer}/ may include only "
                            "${allowed_${layer}} (docs/ARCHITECTURE.md)")
      endif()
    endforeach()
  endforeach()
endforeach()
