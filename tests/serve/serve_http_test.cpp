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

}  // namespace
