# Sourced (never run) by script/rubies: the Rubies that run on the host as themselves, not in
# a chroot. Two kinds:
# - source: built here from the upstream source tarballs in Debian's pool (the `.orig`
#   tarballs, which are Ruby's release tarballs) the way ruby-build, rbenv and images that run
#   `./configure && make install` build them: Ruby's default configure (static, its default
#   -O3 -ggdb3, so the `ruby` executable holds the VM and its full DWARF; make install does
#   not strip), YJIT on where the series has it, with rustc from rustup. These are what most
#   production Rubies outside distributions look like. Built once per machine into
#   $cache/srcrubies/NAME, their compiled-in prefix.
# - extra: any Ruby a developer names by path in RUBYSPY_EXTRA_RUBIES=/path/to/ruby[:...],
#   listed as extra-1, extra-2, ... in that order (a Ruby 4.0 or 4.1 built by hand, say).
#   Never built or changed here.
# Both need the host's libraries (they were built on, or for, this Debian).

srcrubies=$cache/srcrubies
# NAME|KIND|SOURCE (a path under Debian's pool)|configure arguments beyond --prefix
# KIND source-unknown: src-3.4-bp is 3.4.5 again with every control frame one word longer
# (VM_DEBUG_BP_CHECK adds `bp_check` to rb_control_frame_t) and no JIT (YJIT's Rust mirrors
# the frame as Ruby ships it): a Ruby whose layout no table of ours describes. The matrix
# runs it like the others, read through the layout its own DWARF gives (core/src/dwarf/).
source_builds=(
  "src-3.3|source|pool/main/r/ruby3.3/ruby3.3_3.3.8.orig.tar.xz|--enable-yjit"
  "src-3.4|source|pool/main/r/ruby3.4/ruby3.4_3.4.5.orig.tar.xz|--enable-yjit"
  "src-3.4-bp|source-unknown|pool/main/r/ruby3.4/ruby3.4_3.4.5.orig.tar.xz|--disable-yjit cppflags=-DVM_DEBUG_BP_CHECK=1"
)
source_names=()
for _build in "${source_builds[@]}"; do source_names+=("${_build%%|*}"); done
unset _build

# The KIND of a source build.
source_kind() {
  local entry kind
  for entry in "${source_builds[@]}"; do
    [[ ${entry%%|*} == "$1" ]] && { IFS='|' read -r _ kind _ <<<"$entry"; echo "$kind"; return; }
  done
}

# The source builds of KIND (source or source-unknown), built or not.
source_names_of() {
  local name
  for name in "${source_names[@]}"; do [[ $(source_kind "$name") == "$1" ]] && echo "$name"; done
  return 0
}
# What a source build needs from Debian besides build-essential: the headers of the
# libraries its default extensions link (openssl, psych's libyaml, zlib, fiddle's libffi,
# bignum's gmp, readline for irb).
source_packages=(build-essential libssl-dev libyaml-dev zlib1g-dev libffi-dev libgmp-dev libreadline-dev)

is_source() {
  local n
  for n in "${source_names[@]}"; do [[ $1 == "$n" ]] && return 0; done
  return 1
}

# The RUBYSPY_EXTRA_RUBIES entries, one per line, as "NAME BIN".
extra_rubies() {
  local i=0 bin
  local IFS=:
  for bin in ${RUBYSPY_EXTRA_RUBIES-}; do
    [[ -n $bin ]] || continue
    i=$((i + 1))
    echo "extra-$i $bin"
  done
}

is_extra() { [[ $1 == extra-* ]] && extra_rubies | grep -q "^$1 "; }

# Whether NAME runs on the host as itself (no chroot).
is_hostbuilt() { is_source "$1" || is_extra "$1"; }

# The ruby executable of a source build or an extra Ruby (which may not exist yet).
hostbuilt_bin() {
  if is_source "$1"; then
    echo "$srcrubies/$1/bin/ruby"
  else
    extra_rubies | awk -v n="$1" '$1 == n { print $2 }'
  fi
}

# Its prefix: the directory the executable's bin/ is in, where its headers and library are.
hostbuilt_root() {
  local bin
  bin=$(realpath "$(hostbuilt_bin "$1")")
  dirname "$(dirname "$bin")"
}

# Builds one source Ruby if its marker is missing. The build tree is temporary, beside the
# prefix, and goes when the install is done; the prefix gets its marker last, so a build that
# died is built again from scratch.
build_source() {
  local name=$1 entry source conf src tarball tree build prefix=$srcrubies/$1 start=$SECONDS
  [[ -f $prefix/$marker_name ]] && { log "$name: already built ($prefix)"; return; }
  for entry in "${source_builds[@]}"; do [[ ${entry%%|*} == "$name" ]] && break; done
  IFS='|' read -r _ _ source conf <<<"$entry"
  ensure_source_packages
  # rustc for YJIT: rustup's (script/setup), which non-login shells may not have on PATH.
  if [[ -f $HOME/.cargo/env ]]; then . "$HOME/.cargo/env"; fi
  tarball=$cache/ruby-src/${source##*/}
  mkdir -p "$cache/ruby-src" "$srcrubies"
  if [[ ! -f $tarball ]]; then
    log "$name: downloading $mirror/$source"
    curl -sfL --retry 3 -o "$tarball.tmp" "$mirror/$source" || die "$name: could not download $mirror/$source"
    mv "$tarball.tmp" "$tarball"
  fi
  build=$(mktemp -d "$srcrubies/.build-$name.XXXXXX")
  tmp_dir=$build
  build_log=$srcrubies/$name.log
  : >"$build_log"
  rm -rf "$prefix"
  tar -C "$build" -xf "$tarball"
  tree=$(echo "$build"/ruby-*)
  log "$name: configure && make && make install (~6 min on 2 cores, log in $build_log)"
  # Debian's .orig tarballs leave out the bundled gems (gems/*.gem), and with a baseruby
  # make fetches them from rubygems.org, which these machines cannot reach: built without
  # one (a release tarball needs none), the Ruby has its default gems and no bundled ones.
  # shellcheck disable=SC2086 # conf is a list of arguments
  if ! (cd "$tree" && ./configure --prefix="$prefix" --disable-install-doc --with-baseruby=no $conf &&
    make -j"$(nproc)" && make install) >>"$build_log" 2>&1; then
    tail -n 30 "$build_log" >&2
    die "$name: the build failed (full log: $build_log)"
  fi
  remove_tree "$build"
  tmp_dir=
  local version
  version=$("$prefix/bin/ruby" -rjson -e 'print RUBY_VERSION') || die "$name: $prefix/bin/ruby does not run"
  echo "$version $prefix/bin/ruby $(jits_of "$prefix/bin/ruby")" >"$prefix/$marker_name"
  log "$name: Ruby $version ready in $((SECONDS - start)) s, $(du -sh "$prefix" | cut -f1) ($prefix)"
}

ensure_source_packages() {
  local p missing=()
  for p in "${source_packages[@]}"; do
    dpkg -s "$p" 2>/dev/null | grep -q '^Status: install ok installed' || missing+=("$p")
  done
  ((${#missing[@]})) || return 0
  log "installing ${missing[*]} (to build Ruby from source)"
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
}

# Source builds one at a time (each uses every core: never two heavy builds at once, nor two
# processes building the same one).
build_sources() {
  (($#)) || return 0
  mkdir -p "$srcrubies"
  exec 7>"$srcrubies/.lock"
  flock 7
  trap cleanup EXIT
  trap 'exit 130' INT TERM
  local stale name
  for stale in "$srcrubies"/.build-*; do
    [[ -d $stale ]] || continue
    log "removing stale $stale"
    remove_tree "$stale"
  done
  for name in "$@"; do build_source "$name"; done
}

# The JITs a Ruby turns on when asked (--yjit, --zjit), as "yjit,zjit", or "-" for none. A
# Ruby built without one warns and runs without it: only the JIT's own answer counts.
jits_of() {
  local bin=$1 jit jits=()
  for jit in yjit zjit; do
    "$bin" --disable-gems "--$jit" -e "exit(RubyVM::${jit^^}.enabled? ? 0 : 1)" >/dev/null 2>&1 && jits+=("$jit")
  done
  local IFS=,
  echo "${jits[*]:--}"
}

# list's lines for the source builds and the extras: NAME VERSION ROOT BIN KIND JITS. With
# --planned, a source build not built yet too, as it will be: its tarball's version, YJIT
# where its configure asks for it (script/test plans its runs before it builds them).
list_hostbuilt() {
  local name bin version kind jits entry source conf
  for name in "${source_names[@]}"; do
    if [[ ! -f $srcrubies/$name/$marker_name ]]; then
      [[ ${1-} == --planned ]] || continue
      for entry in "${source_builds[@]}"; do [[ ${entry%%|*} == "$name" ]] && break; done
      IFS='|' read -r _ kind source conf <<<"$entry"
      version=${source##*_}
      jits=-
      [[ " $conf " == *" --enable-yjit "* ]] && jits=yjit
      echo "$name ${version%%.orig*} $srcrubies/$name $srcrubies/$name/bin/ruby $kind $jits"
      continue
    fi
    read -r version bin jits <"$srcrubies/$name/$marker_name"
    [[ -n $jits ]] || jits=$(jits_of "$bin") # a marker older than its JITS field
    kind=$(source_kind "$name")
    echo "$name $version $srcrubies/$name $bin $kind ${jits:--}"
  done
  while read -r name bin; do
    [[ -n $name ]] || continue
    [[ -x $bin ]] || { log "RUBYSPY_EXTRA_RUBIES: $bin is not an executable: left out"; continue; }
    version=$("$bin" --disable-gems -e 'print RUBY_VERSION') ||
      { log "RUBYSPY_EXTRA_RUBIES: $bin does not run: left out"; continue; }
    echo "$name $version $(hostbuilt_root "$name") $bin extra $(jits_of "$bin")"
  done < <(extra_rubies)
}
