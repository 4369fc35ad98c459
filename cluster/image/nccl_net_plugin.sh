#!/bin/sh
# Where the aws-ofi-nccl plugin lies in the image, and whether NCCL will find it (cluster/Dockerfile
# runs `link` after AWS's EFA installer and `verify` as its last step). A plugin NCCL cannot dlopen
# is no error to NCCL: it logs one INFO line and carries on over TCP sockets, so the build fails here.
#   nccl_net_plugin.sh find [PREFIX]   the folder holding libnccl-net-ofi.so (PREFIX: /opt/amazon/ofi-nccl)
#   nccl_net_plugin.sh link [PREFIX]   as find, then PREFIX/nccl-lib -> that folder; prints PREFIX/nccl-lib
#   nccl_net_plugin.sh verify [NAME]   the file NCCL_NET_PLUGIN=NAME makes NCCL load (ofi: libnccl-net-ofi.so
#                                      on $LD_LIBRARY_PATH; no NAME: this environment's NCCL_NET_PLUGIN),
#                                      a shared object for this machine; prints its path
# Sources:
# - NCCL src/plugin/net.cc + plugin_open.cc: NCCL_NET_PLUGIN unset -> dlopen("libnccl-net.so"); NAME ->
#   dlopen(NAME), then dlopen("libnccl-net-NAME.so"); not found -> INFO "Could not find", internal IB/Socket.
# - aws/aws-ofi-nccl src/Makefile.am, PR #808 (v1.15): the plugin is libnccl-net-ofi.so, libnccl-net.so
#   beside it unless --disable-nccl-net-symlink; PR #992: the .deb's libdir lost its multiarch folder.
# - EFA installer < 1.44 on Ubuntu: /opt/amazon/ofi-nccl/lib/x86_64-linux-gnu (awslabs/awsome-distributed-ai
#   PR #935, #936); >= 1.44: /opt/amazon/ofi-nccl/lib (PR #894; aws/deep-learning-containers
#   scripts/install_efa.sh check_libnccl_net_so); RPM distributions: lib64.
set -euf  # -f: LD_LIBRARY_PATH is split on ":" and must not glob

me=nccl_net_plugin.sh
LINK_NAME=nccl-lib   # cluster/Dockerfile's LD_LIBRARY_PATH names PREFIX/$LINK_NAME

die() { echo "$me: $*" >&2; exit 1; }

# e_machine of an ELF file built for this machine (ELF spec: EM_X86_64 62, EM_AARCH64 183)
machine() {
  case "$(uname -m)" in
    x86_64) echo 62 ;;
    aarch64|arm64) echo 183 ;;
    *) echo "" ;;   # another machine: the magic, class and type are still checked
  esac
}

# Refuse what dlopen would refuse, from the first 20 bytes alone (no ldd: it may run the file's loader):
# ELF magic, 64-bit little-endian (bytes 4, 5), e_type ET_DYN (16-17), e_machine (18-19).
check_elf() {
  file=$1
  [ -r "$file" ] || die "$file: not readable"
  # shellcheck disable=SC2046  # one word per byte
  set -- $(od -An -v -tu1 -N20 "$file")
  if [ $# -ne 20 ] || [ "$1 $2 $3 $4" != "127 69 76 70" ]; then
    die "$file: not an ELF shared object (no ELF header): reinstall aws-ofi-nccl (EFA installer)"
  fi
  [ "$5 $6" = "2 1" ] || die "$file: not a 64-bit little-endian ELF file (class $5, data $6)"
  [ "${17} ${18}" = "3 0" ] || die "$file: an ELF file but not a shared object (e_type ${17})"
  want=$(machine)
  got=$(( ${19} + 256 * ${20} ))
  [ -z "$want" ] || [ "$got" -eq "$want" ] \
    || die "$file: built for ELF machine $got, this is $(uname -m) (machine $want):" \
           "install the plugin built for this architecture"
}

# The layouts the EFA installer and aws-ofi-nccl's own `make install` have used (see Sources).
LAYOUTS="lib lib64 lib/x86_64-linux-gnu lib/aarch64-linux-gnu"

find_dir() {
  prefix=$1
  for layout in $LAYOUTS; do
    if [ -f "$prefix/$layout/libnccl-net-ofi.so" ]; then
      check_elf "$prefix/$layout/libnccl-net-ofi.so"
      echo "$prefix/$layout"
      return 0
    fi
  done
  die "no libnccl-net-ofi.so in $prefix/{$(echo "$LAYOUTS" | tr ' ' ',')}: is aws-ofi-nccl installed" \
      "(EFA installer without --skip-plugin, aws-ofi-nccl >= 1.15)?"
}

mode=${1:-}
case "$mode" in
  find)
    find_dir "${2:-/opt/amazon/ofi-nccl}"
    ;;
  link)
    prefix=${2:-/opt/amazon/ofi-nccl}
    dir=$(find_dir "$prefix")
    link="$prefix/$LINK_NAME"
    # ln -sfn replaces a link, but would put the new one inside a real folder of that name
    if [ -e "$link" ] && [ ! -L "$link" ]; then die "$link exists and is not a symlink: remove it"; fi
    ln -sfn "${dir#"$prefix"/}" "$link"   # relative: the tree stays valid wherever it is mounted
    echo "$link"
    ;;
  verify)
    # NCCL's own resolution (src/plugin/plugin_open.cc): NAME as given when it holds a "/" or is a
    # lib*.so file name, else libnccl-net-NAME.so; no NAME: $NCCL_NET_PLUGIN, unset: libnccl-net.so.
    name=${2-${NCCL_NET_PLUGIN:-}}
    case "$name" in
      [Nn][Oo][Nn][Ee]) echo "$me: NCCL_NET_PLUGIN=none: NCCL loads no plugin"; exit 0 ;;
      */*) [ -f "$name" ] || die "$name (NCCL_NET_PLUGIN) does not exist: NCCL would fall back to TCP sockets"
           check_elf "$name"; echo "$name"; exit 0 ;;
      "") so=libnccl-net.so ;;
      lib*.so) so=$name ;;
      *) so="libnccl-net-$name.so" ;;
    esac
    # dlopen's order for a bare name: LD_LIBRARY_PATH first, left to right; the first match is loaded.
    # (ld.so.cache may also find it, but that depends on an ldconfig run: the image states the path.)
    old_ifs=$IFS; IFS=:
    for entry in ${LD_LIBRARY_PATH:-}; do
      IFS=$old_ifs
      if [ -n "$entry" ] && [ -f "$entry/$so" ]; then
        check_elf "$entry/$so"
        echo "$entry/$so"
        exit 0
      fi
    done
    IFS=$old_ifs
    die "$so is in no LD_LIBRARY_PATH folder (${LD_LIBRARY_PATH:-unset}): NCCL would fall back to TCP" \
        "sockets; put the folder \`$me find\` prints (or its $LINK_NAME link) on LD_LIBRARY_PATH"
    ;;
  *)
    die "usage: $me find [PREFIX] | link [PREFIX] | verify [NAME] (got '${mode}')"
    ;;
esac
