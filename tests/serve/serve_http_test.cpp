// posenc serve's HTTP edges on loopback: binding, methods, request framing and slow clients.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "serve_support.hpp"

using namespace posenc;
using namespace posenc::test::serve;
using posenc::serve::ServeConfig;

namespace {

TEST(ServeHttp, APortInUseIsRefusedNamingThePort) {
  Running first;
  ServeConfig cfg;
  cfg.port = first.port;
  cfg.served_model_name = "second";
  posenc::serve::Server second(stories().model, stories().tok, cfg);
  const std::string msg = posenc::test::message_of<IoError>([&] { second.start(); });
  EXPECT_NE(msg.find(fmt::format("cannot bind 127.0.0.1:{}: address in use", first.port)), std::string::npos) << msg;
  // The first server still answers every request (no second listener shares the port).
  auto c = first.client(5);
  for (int i = 0; i < 20; ++i) {
    auto r = get(c, "/v1/models");
    ASSERT_EQ(r.status, 200);
    EXPECT_EQ(r.body["data"][0]["id"], "stories260K");
  }
}

TEST(ServeHttp, AMalformedHostIsAConfigErrorNotABindFailure) {
  auto make = [](const std::string& host) {
    ServeConfig c;
    c.host = host;
    posenc::serve::Server s(stories().model, stories().tok, c);
  };
  using posenc::test::message_of;
  EXPECT_EQ(message_of<ConfigError>([&] { make("999.1.1.1"); }), "host: '999.1.1.1' is not a valid IPv4 address");
  EXPECT_EQ(message_of<ConfigError>([&] { make("1.2.3"); }), "host: '1.2.3' is not a valid IPv4 address");
  EXPECT_EQ(message_of<ConfigError>([&] { make("::g"); }), "host: '::g' is not a valid IPv6 address");
  // .invalid never resolves (RFC 2606).
  EXPECT_NE(message_of<ConfigError>([&] { make("example.invalid"); })
                .find("host: 'example.invalid' is neither an IPv4/IPv6 address nor a resolvable host name"),
            std::string::npos);
  // Literal addresses and a resolvable name are accepted (validation only: nothing is bound here).
  for (const char* ok : {"127.0.0.1", "0.0.0.0", "::1", "localhost"}) EXPECT_NO_THROW(make(ok)) << ok;
}

}  // namespace
