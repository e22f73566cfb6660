# Sourced (never run) by script/generate-bindings and script/add-ruby: the table of Rubies
# measured from source (script/lib/ruby-releases.txt) and the functions that fetch a
# release's source tree and measure it. Both scripts measure through measure_release, so a
# release that script/add-ruby measured comes out of script/generate-bindings the same.
#
# Downloads and extracted trees are kept in ${RBSPY_EXT_CACHE:-$HOME/.cache/rbspy_ext}/ruby-src
# (never in the checkout: upstream trees taken from public repositories must not be committed).
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cache=${RBSPY_EXT_CACHE:-$HOME/.cache/rbspy_ext}
src_cache=$cache/ruby-src
mkdir -p "$src_cache"
mirror=${RBSPY_EXT_DEBIAN_MIRROR:-http://deb.debian.org/debian}
# Upstream trees (TREE-src.tar.xz, `git archive`s) a developer keeps by hand, for releases
# whose source no registry here serves (3.0.3, 3.2.11, 4.0.2, 4.1.0-dev): unset, their rows
# cannot be measured again (their committed layouts stand).
ruby_trees=${RBSPY_EXT_RUBY_TREES:-}
releases_file=$root/script/lib/ruby-releases.txt

# Fills `releases` ("release|source|headers") and `aliases` ("release=measured-as") from
# $releases_file, in its order.
load_releases() {
  releases=()
  aliases=()
  local line
  while IFS= read -r line; do
    case $line in
      '' | '#'*) ;;
      *'|'*'|'*) releases+=("$line") ;;
      *=*) aliases+=("$line") ;;
      *) echo "$releases_file: cannot read '$line'" >&2; return 1 ;;
    esac
  done <"$releases_file"
}

# The directory holding ruby/config.h for a table's headers field.
confdir_for() {
  case $1 in
    host:*) echo "/usr/include/x86_64-linux-gnu/${1#host:}" ;;
    chroot:*)
      local rest=${1#chroot:}
      echo "$cache/chroots/${rest%%:*}/usr/include/x86_64-linux-gnu/${rest#*:}" ;;
    srcruby:*)
      # e.g. include/ruby-4.1.0+3/x86_64-linux: the ABI suffix varies, so look it up.
      local conf
      for conf in "/opt/srcrubies/${1#srcruby:}"/include/ruby-*/x86_64-linux; do
        echo "$conf"
        return
      done ;;
  esac
}

# What to do when that config.h is missing.
confdir_hint() {
  case $1 in
    srcruby:*) echo "install that Ruby by hand at /opt/srcrubies/${1#srcruby:} (no registry here serves it)" ;;
    *) echo "run script/rubies build" ;;
  esac
}

# The Ruby that makes an upstream tree's generated headers: the one built from that tree
# when there is one (srcruby), else the host's (only templates are run).
ruby_for() {
  case $1 in
    srcruby:*) echo "/opt/srcrubies/${1#srcruby:}/bin/ruby" ;;
    *) echo "${BASERUBY:-ruby}" ;;
  esac
}

# Prints the source tree of a table's source field, fetched and extracted into the cache the
# first time: a Debian .orig tarball extracts to ruby-VERSION, an upstream tarball to TREE.
fetch_tree() {
  local source=$1 src tarball
  case $source in
    tree:*)
      src=$src_cache/trees/${source#tree:}
      if [ ! -f "$src/vm_core.h" ]; then
        tarball=${ruby_trees:-\$RBSPY_EXT_RUBY_TREES}/${source#tree:}-src.tar.xz
        [ -f "$tarball" ] || { echo "no $tarball for $source" >&2; return 1; }
        mkdir -p "$src_cache/trees"
        tar -C "$src_cache/trees" -xf "$tarball" || return 1
      fi ;;
    pool/*)
      # ruby3.3_3.3.8.orig.tar.xz holds ruby-3.3.8/.
      tarball=${source##*/}
      src=$src_cache/ruby-${tarball#*_}
      src=${src%%.orig.tar.*}
      if [ ! -f "$src/vm_core.h" ]; then
        curl -sfL --retry 3 -o "$src_cache/$tarball" "$mirror/$source" ||
          { echo "could not download $mirror/$source" >&2; return 1; }
        tar -C "$src_cache" -xf "$src_cache/$tarball" || return 1
      fi ;;
    *) echo "unknown source '$source' (pool/... or tree:TREE)" >&2; return 1 ;;
  esac
  echo "$src"
}

# The release a source tree is ("4.0.2"), from its own headers.
tree_version() {
  local src=$1 major minor teeny
  major=$(sed -n 's/^#define RUBY_API_VERSION_MAJOR \([0-9]*\)$/\1/p' "$src/include/ruby/version.h")
  minor=$(sed -n 's/^#define RUBY_API_VERSION_MINOR \([0-9]*\)$/\1/p' "$src/include/ruby/version.h")
  teeny=$(sed -n 's/^#define RUBY_VERSION_TEENY \([0-9]*\)$/\1/p' "$src/version.h")
  [ -n "$major" ] && [ -n "$minor" ] && [ -n "$teeny" ] ||
    { echo "$src: no version in include/ruby/version.h and version.h" >&2; return 1; }
  echo "$major.$minor.$teeny"
}

# An upstream tree is a `git archive`: make the headers its build generated (as common.mk
# and prism/srcs.mk do) with the Ruby built from it, in the cached tree.
generate_headers() {
  local src=$1 ruby=$2 h
  [ -f "$src/id.h" ] ||
    (cd "$src" && "$ruby" tool/generic_erb.rb -o id.h template/id.h.tmpl defs/id.def >/dev/null) ||
    return 1
  [ -f "$src/probes.h" ] ||
    "$ruby" "$src/tool/gen_dummy_probes.rb" "$src/probes.d" >"$src/probes.h" || return 1
  if [ -f "$src/prism/srcs.mk" ]; then
    for h in $(sed -n 's|^\$(srcdir)/\(prism/.*\.h\):.*|\1|p' "$src/prism/srcs.mk"); do
      [ -f "$src/$h" ] || (cd "$src" && "$ruby" prism/templates/template.rb "include/$h" "$h") ||
        return 1
    done
  fi
}

# The probes copy private definitions that have no header; stop, naming the copy, if the
# source no longer matches them.
check_copies() {
  local src=$1 release=$2 symbol_c zjit_h gc_c objspace
  stale() {
    echo "$release: $1 no longer matches the copy in bindings/generator/$2" \
      "(update it there, in from_structs/src/releases.rs and in script/lib/bindings.sh)" >&2
    return 1
  }
  grep -q '#define IMMEDIATE_TABLE_SIZE 54' "$src/iseq.c" ||
    { stale "iseq.c's IMMEDIATE_TABLE_SIZE" layout_probe.c; return 1; }
  grep -q 'static const int ID_ENTRY_UNIT = 512;' "$src/symbol.c" ||
    { stale "symbol.c's ID_ENTRY_UNIT" layout_probe.c; return 1; }
  symbol_c=$(tr -s ' \t\n' ' ' <"$src/symbol.c")
  # ID_ENTRY_SIZE 2 (the probe's id_entry_size), or 4.1's entry struct (see the probe).
  grep -q 'enum id_entry_type { ID_ENTRY_STR, ID_ENTRY_SYM, ID_ENTRY_SIZE };' <<<"$symbol_c" ||
    grep -q 'struct sym_id_entry { VALUE sym; VALUE str; };' <<<"$symbol_c" ||
    { stale "symbol.c's id_entry_type / sym_id_entry" layout_probe.c; return 1; }
  # 4.1's ZJIT keeps a frame's iseq and pc in a JITFrame whose head the probe copies (the
  # master of 2026-08 appends a stack map after materialize_block_code).
  if [ -f "$src/zjit.h" ] && grep -q 'CFP_ZJIT_FRAME' "$src/zjit.h"; then
    zjit_h=$(tr -s ' \t\n' ' ' <"$src/zjit.h")
    grep -q 'typedef struct zjit_jit_frame { // [^}]*const VALUE \*pc; // [^}]*const rb_iseq_t \*iseq; // [^}]*bool materialize_block_code; [^}]*} zjit_jit_frame_t;' <<<"$zjit_h" ||
      { stale "zjit.h's zjit_jit_frame_t" layout_probe.c; return 1; }
    grep -q '#define ZJIT_JIT_RETURN_C_FRAME 0x1' "$src/zjit.h" ||
      { stale "zjit.h's ZJIT_JIT_RETURN_C_FRAME" layout_probe.c; return 1; }
  fi
  # The master of 2026-08 wraps the chunks in a directory, which the probe copies.
  if grep -q 'struct id_entry_dir {' "$src/symbol.c"; then
    grep -q 'struct id_entry_dir { long capa; VALUE \*entries; };' <<<"$symbol_c" ||
      { stale "symbol.c's struct id_entry_dir" layout_probe.c; return 1; }
  fi
  # 4.0 moved rb_symbols_t from symbol.h into symbol.c, which the probe copies.
  grep -q '} rb_symbols_t;' "$src/symbol.h" ||
    grep -q 'typedef struct { rb_atomic_t next_id; VALUE sym_set; VALUE ids; } rb_symbols_t;' <<<"$symbol_c" ||
    { stale "symbol.c's rb_symbols_t" layout_probe.c; return 1; }
  # The GC's flags, private to gc.c: their offset and during_gc's bit are measured (see
  # objspace_flags_at); the reader relies on mode being their first two bits.
  gc_c=$src/gc.c
  [ -f "$src/gc/default/default.c" ] && gc_c=$src/gc/default/default.c
  objspace=$(awk '/^typedef struct rb_objspace \{/,/\} flags;/' "$gc_c" | sed 's|/\*[^/]*\*/||g' | tr -s ' \t\n' ' ')
  grep -q 'struct { unsigned int mode : 2; [^}]*unsigned int during_gc : 1;' <<<"$objspace" ||
    { stale "${gc_c#"$src/"}'s rb_objspace flags (mode, during_gc)" layout_probe.c; return 1; }
}

# "OFFSET BIT": offsetof(rb_objspace_t, flags) and the bit of `during_gc` in them. struct
# rb_objspace is private to gc.c (and the gc/default/default.c it includes from 3.4), so
# compile gc.c itself as the build did (RUBY_EXPORT), with a dummy probes.h if the tree has
# none and an empty gc.rbinc (only its builtin functions, at the end); read the offset as the
# size of an array (nm -S) and the bit from an image of the flags with only during_gc set.
objspace_flags_at() {
  local src=$1 confdir=$2 release=$3 scratch=$src_cache/gc-probe-$3
  mkdir -p "$scratch"
  : >"$scratch/gc.rbinc"
  [ -f "$src/probes.h" ] ||
    "${BASERUBY:-ruby}" "$src/tool/gen_dummy_probes.rb" "$src/probes.d" >"$scratch/probes.h"
  printf '%s\n' '#include "gc.c"' \
    'char rbspy_ext_objspace_flags[offsetof(rb_objspace_t, flags)];' \
    '#undef during_gc /* gc.c names the field through a macro of that name */' \
    '__attribute__((section(".rbspy_during_gc"), used))' \
    'static __typeof__(((rb_objspace_t *)0)->flags) rbspy_ext_during_gc = { .during_gc = 1 };' \
    >"$scratch/gc_probe.c"
  gcc -w -c -DRUBY_EXPORT -I"$src" -I"$src/include" -I"$confdir" -I"$scratch" \
    "$scratch/gc_probe.c" -o "$scratch/gc_probe.o"
  local size bit
  size=$(nm -S "$scratch/gc_probe.o" | awk '$4 == "rbspy_ext_objspace_flags" { print $2 }')
  objcopy -O binary --only-section=.rbspy_during_gc "$scratch/gc_probe.o" "$scratch/during_gc.bin"
  bit=$(od -An -tu1 -v -w1 "$scratch/during_gc.bin" |
    awk '$1 != 0 { b = 0; for (v = $1; v > 1; v /= 2) b++; print (NR - 1) * 8 + b; exit }')
  [ -z "$size" ] || [ -z "$bit" ] || echo "$((16#$size)) $bit"
}

# The GC heap's layout for the heap census (bindings/src/heap.rs): compile
# bindings/generator/heap_probe.c, which includes gc.c as objspace_flags_at does, and print
# one HeapLayout literal from its array sizes (nm -S) and flag images (objcopy).
# The Shapes literal (3.2+) from heap_layout_of's values `v` (see heap_probe.c).
shapes_of() {
  hex() { printf '0x%x' "$1"; }
  some() { if [ -n "${v[$1]+x}" ]; then echo "Some($2)"; else echo None; fi; }
  local out_of_slot list
  if [ -n "${v[robject_heap_flag]+x}" ]; then
    out_of_slot="($(hex "${v[robject_heap_flag]}"), true)"
  else
    out_of_slot="($(hex "${v[robject_embed_flag]}"), false)"
  fi
  if [ -n "${v[vm_shape_list]+x}" ]; then
    list="ShapeList::InVm(${v[vm_shape_list]})"
  elif [ -n "${v[tree_root_shape]+x}" ]; then
    list="ShapeList::TreePointer { shape_list: ${v[tree_shape_list]}, root_shape: ${v[tree_root_shape]}, next_shape_id: ${v[tree_next_shape_id]}, parent_id: ${v[shape_parent_id]} }"
  else
    list="ShapeList::Tree { shape_list: ${v[tree_shape_list]} }"
  fi
  cat <<RUST
Some(Shapes {
    out_of_slot: $out_of_slot,
    fields: ${v[robject_fields]},
    id_shift: ${v[shape_id_shift]},
    index_mask: $(some shape_index_mask "$(hex "${v[shape_index_mask]:-0}")"),
    too_complex_id: $(some too_complex_id "${v[too_complex_id]:-0}"),
    too_complex_flag: $(some too_complex_flag "$(hex "${v[too_complex_flag]:-0}")"),
    shape_size: ${v[shape_size]},
    capacity: ${v[shape_capacity]},
    capacity_width: ${v[shape_capacity_width]},
    list: $list,
    heap_index: $(some shape_heap_index_mask "($(hex "${v[shape_heap_index_mask]:-0}"), ${v[shape_heap_index_shift]:-0})"),
    capacities: $(some tree_capacities "(${v[tree_capacities]:-0}, $([ -n "${v[capacities_inline]+x}" ] && echo true || echo false))"),
})
RUST
}

heap_layout_of() {
  local src=$1 confdir=$2 release=$3 scratch=$src_cache/gc-probe-$3
  local nofree shared_root bins
  bins=$(sed -n 's/^#define MAX_POWER2_FOR_TABLES_WITHOUT_BINS \([0-9]*\)$/\1/p' "$src/st.c")
  nofree=$(sed -n 's/^#define STR_NOFREE \(FL_USER[0-9]*\).*/\1/p' "$src/string.c")
  shared_root=$(cat "$src/array.c" "$src/internal/array.h" 2>/dev/null |
    sed -n 's/^#define RARRAY_SHARED_ROOT_FLAG \(FL_USER[0-9]*\).*/\1/p' | head -1)
  [ -n "$nofree" ] && [ -n "$shared_root" ] && [ -n "$bins" ] ||
    { echo "$release: STR_NOFREE, RARRAY_SHARED_ROOT_FLAG or MAX_POWER2_FOR_TABLES_WITHOUT_BINS not found" >&2; return 1; }
  # heap_probe.c sizes hash.c's private ar_table (before 3.3) from this definition.
  if grep -q '^typedef struct ar_table_struct {' "$src/hash.c"; then
    awk '/^typedef struct ar_table_struct \{/,/\} ar_table;/' "$src/hash.c" |
      sed 's|/\*[^/]*\*/||g' | tr -s ' \t\n' ' ' |
      grep -q '{ ar_table_pair pairs\[RHASH_AR_TABLE_MAX_SIZE\]; } ar_table;' ||
      { echo "$release: hash.c's ar_table changed (see heap_probe.c)" >&2; return 1; }
  fi
  gcc -w -c -DRUBY_EXPORT -DPROBE_STR_NOFREE="$nofree" -DPROBE_ARY_SHARED_ROOT="$shared_root" -DPROBE_ST_BINS_ABOVE="$bins" \
    -I"$src" -I"$src/include" -I"$confdir" -I"$scratch" \
    "$root/bindings/generator/heap_probe.c" -o "$scratch/heap_probe.o" ||
    { echo "$release: bindings/generator/heap_probe.c does not compile against it" >&2; return 1; }
  declare -A v
  local addr size type name
  while read -r addr size type name; do
    v[${name#rbspy_heap_}]=$((16#$size - 1))
  done < <(nm -S "$scratch/heap_probe.o" | awk '$4 ~ /^rbspy_heap_/ && $4 !~ /^rbspy_heap_flag_/')
  flag() { # "(byte, mask)" of the one bit set in section .rbspy_$1
    objcopy -O binary --only-section=".rbspy_$1" "$scratch/heap_probe.o" "$scratch/$1.bin"
    od -An -tu1 -v -w1 "$scratch/$1.bin" | awk '$1 != 0 { printf "(%d, 0x%02x)", NR - 1, $1; exit }'
  }
  opt() { if [ -n "${v[$1]+x}" ]; then echo "Some(${v[$1]})"; else echo None; fi; }
  local darray=None tomb=None pending=None
  [ -n "${v[pending_cache]+x}" ] &&
    pending="Some(crate::heap::Pending { cache: ${v[pending_cache]}, at: ${v[pending_at]}, stride: ${v[pending_stride]} })"
  [ -n "${v[darray_data]+x}" ] && darray="Some((${v[darray_size]}, ${v[darray_data]}))"
  objdump -h "$scratch/heap_probe.o" | grep -q '\.rbspy_in_tomb' && tomb="Some($(flag in_tomb))"
  local robject=None
  [ -n "${v[robject_embed]+x}" ] && robject="Some((0x$(printf %x "${v[robject_embed]}"), ${v[robject_numiv]}))"
  local shapes=None ractor_heaps=None fields=None
  # The master of 2026-08 needs no shape list: an object's ivars out of its slot are an
  # imemo_fields object of their own (`fields`), sized apart.
  [ -n "${v[shape_size]+x}" ] && [ -n "${v[robject_fields]+x}" ] && shapes=$(shapes_of)
  if [ -n "${v[fields_complex_table]+x}" ]; then
    fields="Some(crate::heap::Fields { imemo_type: ${v[imemo_fields]}, type_shift: ${v[imemo_type_shift]}, type_mask: 0x$(printf %x "${v[imemo_type_mask]}"), id_shift: ${v[shape_id_shift]}, complex_flag: 0x$(printf %x "${v[too_complex_flag]}"), table: ${v[fields_complex_table]} })"
  fi
  if [ -n "${v[page_objspace]+x}" ]; then
    ractor_heaps="Some(crate::heap::RactorHeaps { creating_child: ${v[ractor_creating_child_objspace]}, zombies: ${v[vm_zombie_objspaces]}, zombie_count: ${v[vm_zombie_objspaces_count]}, zombie_size: ${v[zombie_objspace_size]}, zombie_owner: ${v[zombie_objspace_owner]}, page_objspace: ${v[page_objspace]} })"
  fi
  cat <<RUST
("$release", HeapLayout {
    sorted: ${v[sorted]},
    allocated_pages: $(opt allocated_pages),
    darray: $darray,
    page_align: ${v[page_align]},
    page_start: ${v[page_start]},
    page_total_slots: ${v[page_total_slots]},
    page_free_slots: ${v[page_free_slots]},
    page_final_slots: ${v[page_final_slots]},
    page_slot_size: $(opt page_slot_size),
    page_mark_bits: ${v[page_mark_bits]},
    page_mark_bits_len: ${v[page_mark_bits_len]},
    page_before_sweep: $(flag before_sweep),
    page_in_tomb: $tomb,
    base_slot_size: ${v[base_slot_size]},
    bitmap_by_index: $([ -n "${v[bitmap_by_index]+x}" ] && echo true || echo false),
    gc_mode_sweeping: ${v[gc_mode_sweeping]},
    compact_count: ${v[compact_count]},
    during_compacting: $(flag during_compacting),
    allocated: Allocated { at: ${v[allocated_at]}, stride: ${v[allocated_stride]}, count: ${v[allocated_count]}, pending: $pending },
    str_shared: 0x$(printf %x "${v[str_shared]}"),
    str_nofree: 0x$(printf %x "${v[str_nofree]}"),
    rstring_capa: ${v[rstring_capa]},
    ary_shared: 0x$(printf %x "${v[ary_shared]}"),
    ary_shared_root: 0x$(printf %x "${v[ary_shared_root]}"),
    rarray_capa: ${v[rarray_capa]},
    hash_st_flag: 0x$(printf %x "${v[hash_st_flag]}"),
    hash_st_inline: $(opt hash_st_inline),
    hash_st_ptr: $(opt hash_st_ptr),
    ar_table_size: $(opt ar_table_size),
    st_table_size: ${v[st_table_size]},
    st_entry_power: ${v[st_entry_power]},
    st_bins_above_power: ${v[st_bins_above_power]},
    st_bins: $(opt st_bins),
    robject_heap: $robject,
    shapes: $shapes,
    class_super: $(opt class_super),
    class_super_in_ext: $(opt class_super_in_ext),
    ractor_heaps: $ractor_heaps,
    fields: $fields,
}),
RUST
}

# Measures one line of the table: compiles bindings/generator/layout_probe.c and
# heap_probe.c against the release's internal headers plus its own configured config.h, so
# every #if resolves as in the real build. Sets layout_body (one Layout literal, named
# after the minor series) and heap_body (one `("release", HeapLayout {...}),` entry).
measure_release() {
  local release=$1 source=$2 headers=$3 confdir src flags_at
  confdir=$(confdir_for "$headers")
  if [ ! -f "$confdir/ruby/config.h" ]; then
    echo "missing ${confdir:-config.h of $headers}/ruby/config.h for $release ($(confdir_hint "$headers"))" >&2
    return 1
  fi
  src=$(fetch_tree "$source") || return 1
  case $source in
    tree:*) generate_headers "$src" "$(ruby_for "$headers")" ||
      { echo "$release: could not make $src's generated headers" >&2; return 1; } ;;
  esac
  check_copies "$src" "$release" || return 1
  flags_at=$(objspace_flags_at "$src" "$confdir" "$release")
  [ -n "$flags_at" ] || { echo "$release: could not measure rb_objspace flags" >&2; return 1; }
  heap_body=$(heap_layout_of "$src" "$confdir" "$release") || return 1
  # What the master of 2026-08 (4.1.0) changed beyond offsets, told by the tree itself:
  # each Ractor owns its heap (rb_ractor_t has `objspace`), and the symbol table keeps its
  # chunks in a directory (symbol.c's struct id_entry_dir, checked by check_copies), and a
  # method definition records the module it was defined in (method.h's original_module).
  local defines=() ractor_struct
  ractor_struct=$(awk '/^struct rb_ractor_struct \{/,/^\};/' "$src/ractor_core.h" 2>/dev/null || true)
  if grep -q '^ *void \*objspace;' <<<"$ractor_struct"; then defines+=(-DPROBE_RACTOR_OBJSPACE); fi
  if grep -q 'struct id_entry_dir {' "$src/symbol.c"; then defines+=(-DPROBE_ID_ENTRY_DIR); fi
  if grep -q '^ *VALUE original_module;' "$src/method.h"; then defines+=(-DPROBE_ORIGINAL_MODULE); fi
  gcc -w -DLAYOUT_NAME="\"${release%.*}\"" -DOBJSPACE_FLAGS="${flags_at% *}" \
    -DOBJSPACE_DURING_GC_BIT="${flags_at#* }" "${defines[@]}" \
    -I"$src" -I"$src/include" -I"$confdir" \
    "$root/bindings/generator/layout_probe.c" -o "$src_cache/probe-$release" ||
    { echo "$release: bindings/generator/layout_probe.c does not compile against it" >&2; return 1; }
  layout_body=$("$src_cache/probe-$release") || return 1
}
