package envelope

// StartTestRedis starts a private redis-server on a free loopback port for the
// tests of package envelope_test; it returns its URL and a function stopping it.
var StartTestRedis = startRedis
