#!/usr/bin/env bash
# Fresh secrets for a DroidMesh deployment: one random NATS password per user of
# infra/nats/nats-auth.conf (or the conf DM_NATS_AUTH_CONF names) and a throwaway CA with a NATS
# server certificate, written under DIR (default: infra/secrets/local, git-ignored):
#
#   DIR/nats.env              DM_NATS_PASSWORD_<USER>=... (the variables the conf names) for
#                             nats-server (compose env_file; kubectl create secret generic
#                             droidmesh-nats --from-env-file)
#   DIR/passwords/<user>      the same password, one file per user (DM_NATS_PASSWORD_FILE)
#   DIR/tls/ca.pem            the CA clients verify the server with (DM_NATS_TLS_CA)
#   DIR/tls/ca-key.pem        the CA's key: only needed to issue more certificates
#   DIR/tls/server.pem        the NATS server certificate, and server-key.pem its key
#   DIR/gateway/keys.toml     the gateway's key file (DM_GATEWAY_API_KEYS): one key, tenant
#                             `local`, every model; `droidmesh keys add --file` adds more
#   DIR/gateway/key           that key itself, for your local clients (the file above has its hash)
#
# Files that exist are kept (re-running is safe; passwords stay, certificates you brought stay), so
# after `droidmesh nats-auth` adds users, running it again makes only the new users' passwords.
# Delete a file to have it made again: e.g. tls/server.pem and tls/server-key.pem to re-issue the
# server certificate from the same CA (with DM_TLS_EXTRA_SANS="DNS:nats.example.com,IP:10.0.0.5"
# for more names). DM_TLS_NAMESPACE (default droidmesh) names the Kubernetes service's namespace,
# DM_TLS_DAYS (default 365) the certificates' lifetime. Needs openssl (1.1.1 or later).
#
# Usage: bash infra/secrets/generate.sh [DIR]
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DIR=${1:-"$HERE/local"}
AUTH_CONF=${DM_NATS_AUTH_CONF:-"$HERE/../nats/nats-auth.conf"}
# "user env-variable" for every `{ user: NAME, password: $VARIABLE` line of the conf.
USERS=$(sed -n 's/^[[:space:]]*{ user: \([A-Za-z0-9_-]*\), password: \$\([A-Z0-9_]*\).*/\1 \2/p' "$AUTH_CONF")
[[ -n "$USERS" ]] || { echo "generate.sh: no users in $AUTH_CONF" >&2; exit 1; }
NAMESPACE=${DM_TLS_NAMESPACE:-droidmesh}
DAYS=${DM_TLS_DAYS:-365}

umask 077
mkdir -p "$DIR/passwords" "$DIR/tls"
chmod 700 "$DIR"
# Containers read the files below through bind mounts as their own (non-root) user: the files are
# world-readable, the directory holding them is not (0700).
chmod 755 "$DIR/passwords" "$DIR/tls"

# Passwords: 32 random alphanumerics per user (no characters that need quoting anywhere).
while read -r user _; do
  file="$DIR/passwords/$user"
  if [[ ! -s "$file" ]]; then
    password=$(LC_ALL=C tr -dc 'A-Za-z0-9' </dev/urandom | head -c 32 || true)
    [[ ${#password} -eq 32 ]] || { echo "generate.sh: could not read /dev/urandom" >&2; exit 1; }
    printf '%s\n' "$password" >"$file"
  fi
  chmod 644 "$file"
done <<<"$USERS"
env_tmp="$DIR/nats.env.tmp"
: >"$env_tmp"
while read -r user variable; do
  echo "$variable=$(head -n 1 "$DIR/passwords/$user")" >>"$env_tmp"
done <<<"$USERS"
mv "$env_tmp" "$DIR/nats.env"

# TLS: a throwaway CA and a server certificate for NATS, unless already there.
tls="$DIR/tls"
if [[ -s "$tls/server.pem" && -s "$tls/server-key.pem" ]]; then
  [[ -s "$tls/ca.pem" ]] || { echo "generate.sh: $tls/server.pem is there but not ca.pem (the CA that issued it)" >&2; exit 1; }
  echo "generate.sh: keeping the certificates in $tls" >&2
else
  command -v openssl >/dev/null || { echo "generate.sh: openssl is needed for the TLS certificates" >&2; exit 1; }
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  sans="DNS:nats,DNS:nats.$NAMESPACE,DNS:nats.$NAMESPACE.svc,DNS:nats.$NAMESPACE.svc.cluster.local"
  sans+=",DNS:localhost,IP:127.0.0.1,IP:::1${DM_TLS_EXTRA_SANS:+,$DM_TLS_EXTRA_SANS}"
  cat >"$work/openssl.cnf" <<EOF
[req]
distinguished_name = dn
prompt = no
[dn]
CN = unused
[ca]
basicConstraints = critical,CA:TRUE,pathlen:0
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
[server]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = $sans
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
EOF
  if [[ ! -s "$tls/ca.pem" ]]; then
    openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$tls/ca-key.pem" 2>/dev/null
    openssl req -new -x509 -config "$work/openssl.cnf" -extensions ca -key "$tls/ca-key.pem" \
      -subj "/O=DroidMesh/CN=DroidMesh throwaway CA $(date -u +%Y%m%dT%H%M%SZ)" -days "$DAYS" -out "$tls/ca.pem"
  fi
  [[ -s "$tls/ca-key.pem" ]] || { echo "generate.sh: $tls/ca.pem is there but not ca-key.pem: cannot issue a server certificate" >&2; exit 1; }
  openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$tls/server-key.pem" 2>/dev/null
  openssl req -new -config "$work/openssl.cnf" -key "$tls/server-key.pem" -subj "/O=DroidMesh/CN=nats" -out "$work/server.csr"
  openssl x509 -req -in "$work/server.csr" -CA "$tls/ca.pem" -CAkey "$tls/ca-key.pem" -set_serial "0x$(openssl rand -hex 16)" \
    -days "$DAYS" -extfile "$work/openssl.cnf" -extensions server -out "$tls/server.pem" 2>/dev/null
  openssl verify -CAfile "$tls/ca.pem" "$tls/server.pem" >/dev/null
  echo "generate.sh: issued $tls/server.pem for $sans" >&2
fi
chmod 644 "$tls/ca.pem" "$tls/server.pem"
chmod 600 "$tls/server-key.pem"
[[ ! -e "$tls/ca-key.pem" ]] || chmod 600 "$tls/ca-key.pem"
# The gateway's first API key: dmk_<12 hex>_<43 urlsafe base64>, as `droidmesh keys add` makes.
mkdir -p "$DIR/gateway"
chmod 755 "$DIR/gateway"
if [[ ! -s "$DIR/gateway/keys.toml" ]]; then
  command -v openssl >/dev/null || { echo "generate.sh: openssl is needed for the gateway key" >&2; exit 1; }
  kid=$(openssl rand -hex 6)
  key="dmk_${kid}_$(openssl rand -base64 32 | tr '+/' '-_' | tr -d '=\n')"
  digest=$(printf '%s' "$key" | openssl dgst -sha256 -r | cut -d' ' -f1)
  printf '%s\n' "$key" >"$DIR/gateway/key"
  # scope_secret: tenants' cache scopes are HMACs under it (shared/auth/keys.py)
  printf 'scope_secret = "%s"\n\n[[key]]\nid = "%s"\nhash = "sha256:%s"\ntenant = "local"\nmodels = ["*"]\nrequests_per_minute = 600\ntokens_per_minute = 1000000\nmax_concurrent = 16\n\n' \
    "$(openssl rand -hex 32)" "$kid" "$digest" >"$DIR/gateway/keys.toml"
fi
chmod 644 "$DIR/gateway/keys.toml"  # read by the gateway container's own user; key hashes and the scope secret
[[ ! -e "$DIR/gateway/key" ]] || chmod 600 "$DIR/gateway/key"  # gone once handed out: the hash file is enough
echo "generate.sh: secrets in $DIR (passwords for: $(cut -d' ' -f1 <<<"$USERS" | paste -sd' ' -))" >&2
