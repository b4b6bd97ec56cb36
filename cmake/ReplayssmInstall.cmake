# `cmake --install <build> --prefix P`: the public headers, the library and a CMake package,
# so that another project does
#   find_package(replayssm CONFIG REQUIRED)
#   target_link_libraries(app PRIVATE replayssm::replayssm)
# The library's own headers (src/) are not installed; nor is anything that only builds it
# (nlohmann_json, CLI11, GoogleTest).
include(CMakePackageConfigHelpers)

set(replayssm_cmake_dir ${CMAKE_INSTALL_LIBDIR}/cmake/replayssm)

install(TARGETS replayssm EXPORT replayssmTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/replayssm
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} FILES_MATCHING PATTERN "*.h")
install(FILES ${PROJECT_BINARY_DIR}/include/replayssm/version.h
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/replayssm)
install(EXPORT replayssmTargets NAMESPACE replayssm:: DESTINATION ${replayssm_cmake_dir})

# What a consumer's link needs besides libreplayssm: nothing for a shared library (it holds the
# static CUDA runtime and links libgomp itself); for a static one, OpenMP's runtime and, with
# CUDA, the static CUDA runtime, which the package finds as this build did.
set(replayssm_config_dependencies "")
if(NOT BUILD_SHARED_LIBS)
  string(APPEND replayssm_config_dependencies "find_dependency(OpenMP COMPONENTS CXX)\n")
  if(REPLAYSSM_ENABLE_CUDA)
    string(APPEND replayssm_config_dependencies "find_dependency(CUDAToolkit)\n")
  endif()
endif()
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/replayssmConfig.cmake.in
  ${PROJECT_BINARY_DIR}/replayssmConfig.cmake INSTALL_DESTINATION ${replayssm_cmake_dir})
# 0.x: a new minor version may change the API.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/replayssmConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/replayssmConfig.cmake
              ${PROJECT_BINARY_DIR}/replayssmConfigVersion.cmake
  DESTINATION ${replayssm_cmake_dir})
