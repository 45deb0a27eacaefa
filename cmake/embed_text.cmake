# Writes OUTPUT: a header defining `inline constexpr const char* NAME` with the
# text of INPUT (used to embed schemas/job.fbs for runtime JSON parsing).
file(READ "${INPUT}" content)
file(WRITE "${OUTPUT}.tmp" "// Generated from ${INPUT}; do not edit.\n#pragma once\nnamespace leasehold {\ninline constexpr const char* ${NAME} = R\"LHEMBED(${content})LHEMBED\";\n}\n")
file(COPY_FILE "${OUTPUT}.tmp" "${OUTPUT}" ONLY_IF_DIFFERENT)
