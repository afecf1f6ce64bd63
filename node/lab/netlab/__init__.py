"""netlab: two hosts as network namespaces joined by a shaped veth pair."""
