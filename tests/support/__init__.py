"""Support code the tests share: servers, proxies, simulated engines and hosts, fixtures."""
