// posenc — typed errors.
//
// Every failure caused by bad input is reported by throwing one of these
// types. The message always names the offending field (or file) and the bad
// value, so the CLI can print it verbatim and exit non-zero.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

#include <fmt/format.h>

namespace posenc {

/// Base of every posenc exception.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A configuration value (config.json field, CLI flag, spec field) is missing,
/// malformed or out of range. Message: "<field>: <what is wrong> (got <value>)".
class ConfigError : public Error {
 public:
  using Error::Error;
};

/// A checkpoint file is truncated, empty or internally inconsistent.
class CheckpointError : public Error {
 public:
  using Error::Error;
};

/// A tokenizer file is malformed, or does not fit the model it is used with.
class TokenizerError : public Error {
 public:
  using Error::Error;
};

/// A position id is out of the range an encoding or table supports
/// (e.g. past a learned position table), or negative where it cannot be.
class PositionError : public Error {
 public:
  using Error::Error;
};

/// An argument to a library call is inconsistent (shape mismatch, odd
/// rotary_dim, non-finite value, ...).
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

/// A file could not be read or written.
class IoError : public Error {
 public:
  using Error::Error;
};

/// A KV-cache operation would break position semantics (e.g. keys rotated
/// with one theta mixed with queries rotated with another).
class CacheError : public Error {
 public:
  using Error::Error;
};

/// A file posenc wrote and reads back (an eval run directory's run.json and
/// cells, a study directory's study.json and evals/*.json) is malformed,
/// inconsistent with its name or settings, or was edited. Message:
/// "<file>: <key path>: <what is wrong>".
class DataError : public Error {
 public:
  using Error::Error;
};

/// A tensor dump given to `posenc verify` (.npy, .npz, safetensors) is
/// malformed, or lacks an array or shape the check needs. Message:
/// "<file>: <array>: <what is wrong> (got <value>)".
class DumpError : public Error {
 public:
  using Error::Error;
};

/// A forward pass gave a value that cannot be scored or sampled: a logit that is
/// NaN or infinite (float32 overflowed inside the model: weights or activations
/// too large for it, though every weight is finite). Message: "<where>: logit
/// <index> is not finite (got <value>) ...".
class NumericError : public Error {
 public:
  using Error::Error;
};

/// Throws E with "<field>: <reason> (got <value>)".
template <class E, class V>
[[noreturn]] void fail_field(std::string_view field, std::string_view reason, const V& value) {
  throw E(fmt::format("{}: {} (got {})", field, reason, value));
}

}  // namespace posenc
