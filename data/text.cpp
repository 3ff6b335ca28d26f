// Text as character-level tokens: a file or a folder of files (Debian's fortunes), held out per
// file, cut into next-token windows.
#include <actorpipe/data.hpp>

#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

namespace actorpipe {
namespace {

namespace fs = std::filesystem;

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw pipeline_error(detail::concat("text: cannot read '", path.string(), "'"),
                         error_details{error_kind::io});
  }
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// The offset of the first byte that is not well-formed UTF-8, or npos.
std::size_t invalid_utf8(const std::string& text) {
  std::size_t i = 0;
  while (i < text.size()) {
    auto c = static_cast<unsigned char>(text[i]);
    // Continuation bytes after a lead byte of 2, 3 or 4 bytes; 4 marks no valid lead byte.
    std::size_t extra = c < 0x80           ? 0
                        : (c >> 5) == 0x6  ? 1
                        : (c >> 4) == 0xe  ? 2
                        : (c >> 3) == 0x1e ? 3
                                           : 4;
    if (extra == 4 || (extra == 1 && c < 0xc2) || i + extra >= text.size()) {
      return i;
    }
    for (std::size_t k = 1; k <= extra; ++k) {
      if ((static_cast<unsigned char>(text[i + k]) >> 6) != 0x2) {
        return i;
      }
    }
    i += extra + 1;
  }
  return std::string::npos;
}

std::vector<fs::path> text_files(const std::string& path) {
  std::error_code ec;
  if (fs::is_regular_file(path, ec)) {
    return {path};
  }
  bool fortunes = fs::path(path).lexically_normal() == fs::path(default_fortunes_dir());
  ACTORPIPE_CHECK(fs::is_directory(path, ec), "text: '", path, "' is neither a file nor a folder",
                  fortunes ? " (install Debian's fortunes package: apt-get install fortunes)" : "");
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(path)) {
    if (entry.is_symlink() || !entry.is_regular_file() || entry.path().extension() == ".dat") {
      continue;
    }
    files.push_back(entry.path());
  }
  std::sort(files.begin(), files.end());
  ACTORPIPE_CHECK(!files.empty(), "text: the folder '", path, "' holds no text files",
                  fortunes ? " (install Debian's fortunes package: apt-get install fortunes)" : "");
  return files;
}

} // namespace

torch::Tensor text_corpus::encode(const std::string& text) const {
  std::array<int64_t, 256> index;
  index.fill(-1);
  for (std::size_t i = 0; i < alphabet.size(); ++i) {
    index[static_cast<unsigned char>(alphabet[i])] = static_cast<int64_t>(i);
  }
  auto ids = torch::empty({static_cast<int64_t>(text.size())}, torch::kLong);
  auto* out = ids.data_ptr<int64_t>();
  for (std::size_t i = 0; i < text.size(); ++i) {
    auto id = index[static_cast<unsigned char>(text[i])];
    ACTORPIPE_CHECK(id >= 0, "text: byte ", static_cast<int>(static_cast<unsigned char>(text[i])),
                    " at offset ", i, " is not in the alphabet of '", source, "'");
    out[i] = id;
  }
  return ids;
}

std::string text_corpus::decode(const torch::Tensor& ids) const {
  auto flat = ids.to(torch::kLong).contiguous().view(-1);
  std::string text;
  text.reserve(static_cast<std::size_t>(flat.numel()));
  const auto* in = flat.data_ptr<int64_t>();
  for (int64_t i = 0; i < flat.numel(); ++i) {
    ACTORPIPE_CHECK(in[i] >= 0 && in[i] < vocabulary(), "text: token ", in[i],
                    " is not in the vocabulary of ", vocabulary());
    text += alphabet[static_cast<std::size_t>(in[i])];
  }
  return text;
}

text_corpus load_text(const std::string& path) {
  text_corpus corpus;
  corpus.source = path;
  std::string train;
  std::string validation;
  for (const auto& file : text_files(path)) {
    auto text = read_file(file);
    auto bad = invalid_utf8(text);
    if (bad != std::string::npos) {
      throw pipeline_error(
        detail::concat("text: '", file.string(), "' is not UTF-8 text (byte ", bad, ")"),
        error_details{error_kind::io});
    }
    auto held = text.size() / 10;
    train += text.substr(0, text.size() - held);
    validation += text.substr(text.size() - held);
  }
  if (train.size() < 2 || validation.size() < 2) {
    throw pipeline_error(detail::concat("text: '", path, "' holds ",
                                        train.size() + validation.size(),
                                        " bytes, too few to hold out a tenth for validation"),
                         error_details{error_kind::io});
  }
  std::array<bool, 256> seen{};
  for (unsigned char c : train + validation) {
    seen[c] = true;
  }
  for (int c = 0; c < 256; ++c) {
    if (seen[static_cast<std::size_t>(c)]) {
      corpus.alphabet += static_cast<char>(c);
    }
  }
  corpus.train = corpus.encode(train);
  corpus.validation = corpus.encode(validation);
  return corpus;
}

dataset text_windows(const torch::Tensor& tokens, int64_t context) {
  ACTORPIPE_CHECK(context >= 1, "text: context (", context, ") must be >= 1");
  auto n = (tokens.numel() - 1) / context;
  ACTORPIPE_CHECK(n >= 1, "text: ", tokens.numel(), " tokens hold no window of ", context + 1);
  // Window i covers tokens [i * context, i * context + context]: inputs and targets overlap by
  // all but one token.
  dataset d;
  d.images = tokens.slice(0, 0, n * context).view({n, context}).clone();
  d.labels = tokens.slice(0, 1, n * context + 1).view({n, context}).clone();
  return d;
}

} // namespace actorpipe
